#include "tinydev/hcq.hpp"

namespace tinydev {

void fill_kernargs(const Program& program, const Kernargs& kernargs, std::span<const Allocation> buffers,
                   std::span<const std::int32_t> values) {
  if (auto sig = program.signature(); sig && !sig->accepts_either(buffers.size(), values.size()))
    throw InvalidArgument(fmt::format("kernel '{}' takes {} buffers and {} values, got {} and {}", program.name(),
                                      sig->num_buffers, sig->num_values, buffers.size(), values.size()));
  if (kernargs.num_buffers != buffers.size() || kernargs.num_values != values.size())
    throw InvalidArgument(fmt::format("kernargs for '{}' were allocated for {} buffers and {} values, got {} and {}",
                                      program.name(), kernargs.num_buffers, kernargs.num_values, buffers.size(),
                                      values.size()));
  for (std::size_t i = 0; i < buffers.size(); ++i) kernargs.set_buffer(i, buffers[i].va_addr);
  for (std::size_t i = 0; i < values.size(); ++i) kernargs.set_value(i, values[i]);
}

}  // namespace tinydev
