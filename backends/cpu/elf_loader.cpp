#include "elf_loader.hpp"

#include <elf.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <vector>
#include <unordered_map>

namespace tinydev::cpu {

namespace {

struct Elf {
  const unsigned char* data = nullptr;
  std::size_t size = 0;
  const Elf64_Ehdr* header = nullptr;
  std::span<const Elf64_Shdr> sections;
  std::span<const Elf64_Sym> symbols;
  const char* strings = nullptr;  // the symbol string table
  std::size_t strings_size = 0;
  const char* section_names = nullptr;
  std::size_t section_names_size = 0;

  bool in_bounds(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size && length <= size - offset;
  }
  std::string_view symbol_name(const Elf64_Sym& s) const {
    if (s.st_name >= strings_size) return {};
    return std::string_view(strings + s.st_name, ::strnlen(strings + s.st_name, strings_size - s.st_name));
  }
  std::string_view section_name(const Elf64_Shdr& s) const {
    if (!section_names || s.sh_name >= section_names_size) return {};
    return std::string_view(section_names + s.sh_name,
                            ::strnlen(section_names + s.sh_name, section_names_size - s.sh_name));
  }
};

// Parses the header, section table and symbol table with bounds checks; false if malformed.
bool parse(std::span<const std::byte> blob, Elf& elf) {
  elf.data = reinterpret_cast<const unsigned char*>(blob.data());
  elf.size = blob.size();
  if (elf.size < sizeof(Elf64_Ehdr) || std::memcmp(elf.data, ELFMAG, SELFMAG) != 0) return false;
  elf.header = reinterpret_cast<const Elf64_Ehdr*>(elf.data);
  const Elf64_Ehdr& h = *elf.header;
  if (h.e_ident[EI_CLASS] != ELFCLASS64 || h.e_ident[EI_DATA] != ELFDATA2LSB || h.e_type != ET_REL)
    return false;
  if (h.e_shentsize != sizeof(Elf64_Shdr) || h.e_shoff % 8 != 0 ||
      !elf.in_bounds(h.e_shoff, std::uint64_t{h.e_shnum} * sizeof(Elf64_Shdr)))
    return false;
  elf.sections = {reinterpret_cast<const Elf64_Shdr*>(elf.data + h.e_shoff), h.e_shnum};
  if (h.e_shstrndx < h.e_shnum) {
    const Elf64_Shdr& names = elf.sections[h.e_shstrndx];
    if (elf.in_bounds(names.sh_offset, names.sh_size)) {
      elf.section_names = reinterpret_cast<const char*>(elf.data + names.sh_offset);
      elf.section_names_size = names.sh_size;
    }
  }
  for (const Elf64_Shdr& s : elf.sections) {
    if (s.sh_type != SHT_SYMTAB) continue;
    if (s.sh_entsize != sizeof(Elf64_Sym) || s.sh_offset % 8 != 0 || !elf.in_bounds(s.sh_offset, s.sh_size) ||
        s.sh_link >= h.e_shnum)
      return false;
    const Elf64_Shdr& str = elf.sections[s.sh_link];
    if (!elf.in_bounds(str.sh_offset, str.sh_size)) return false;
    elf.symbols = {reinterpret_cast<const Elf64_Sym*>(elf.data + s.sh_offset), s.sh_size / sizeof(Elf64_Sym)};
    elf.strings = reinterpret_cast<const char*>(elf.data + str.sh_offset);
    elf.strings_size = str.sh_size;
  }
  return true;
}

std::size_t align_up(std::size_t v, std::size_t a) { return a <= 1 ? v : (v + a - 1) / a * a; }

// ELF structures are read in place, which needs 8-byte alignment: copy a misaligned blob first.
struct Aligned {
  std::vector<std::uint64_t> storage;
  std::span<const std::byte> bytes;
  explicit Aligned(std::span<const std::byte> blob) : bytes(blob) {
    if (reinterpret_cast<std::uintptr_t>(blob.data()) % alignof(Elf64_Ehdr) == 0) return;
    storage.resize((blob.size() + 7) / 8);
    std::memcpy(storage.data(), blob.data(), blob.size());
    bytes = std::span<const std::byte>(reinterpret_cast<const std::byte*>(storage.data()), blob.size());
  }
};

bool skipped_section(const Elf& elf, const Elf64_Shdr& s) {
  // Unwind tables are only for debuggers and exceptions, which kernels do not throw; loading them
  // would mean registering them with the unwinder.
  return s.sh_type == SHT_X86_64_UNWIND || elf.section_name(s) == ".eh_frame";
}

}  // namespace

LoadedObject::~LoadedObject() {
  if (base_) ::munmap(base_, size_);
}

std::optional<std::vector<std::string>> elf_functions(std::span<const std::byte> blob) {
  Aligned aligned(blob);
  Elf elf;
  if (!parse(aligned.bytes, elf)) return std::nullopt;
  std::vector<std::string> out;
  for (const Elf64_Sym& s : elf.symbols)
    if (ELF64_ST_TYPE(s.st_info) == STT_FUNC && ELF64_ST_BIND(s.st_info) != STB_LOCAL && s.st_shndx != SHN_UNDEF)
      out.emplace_back(elf.symbol_name(s));
  return out;
}

ElfLoadResult load_elf_x86_64(std::span<const std::byte> blob, std::string_view function,
                              const SymbolResolver& resolve) {
  ElfLoadResult result;
  auto decline = [&](std::string why) {
    result.declined = std::move(why);
    return std::move(result);
  };
  Aligned aligned(blob);
  Elf elf;
  if (!parse(aligned.bytes, elf)) return decline("not an ELF64 little-endian relocatable object");
  if (elf.header->e_machine != EM_X86_64) return decline("not an x86-64 object");
  const std::size_t nsec = elf.sections.size();

  // 1. Which sections load.
  std::vector<bool> loaded(nsec, false);
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& s = elf.sections[i];
    if (!(s.sh_flags & SHF_ALLOC) || s.sh_size == 0 || skipped_section(elf, s)) continue;
    const std::string_view name = elf.section_name(s);
    if (name.starts_with(".init_array") || name.starts_with(".fini_array") || name.starts_with(".ctors") ||
        (s.sh_flags & SHF_TLS))
      return decline(fmt::format("section {} needs initializers or TLS", name));
    if (s.sh_type != SHT_NOBITS && !elf.in_bounds(s.sh_offset, s.sh_size))
      return decline("section out of bounds");
    loaded[i] = true;
  }

  // 2. Which symbols need a GOT slot or a call stub.
  std::unordered_map<std::uint32_t, std::size_t> got_slot, stub_slot;
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& r = elf.sections[i];
    if (r.sh_type == SHT_REL) return decline("REL relocations (x86-64 objects use RELA)");
    if (r.sh_type != SHT_RELA || r.sh_info >= nsec || !loaded[r.sh_info]) continue;
    if (r.sh_entsize != sizeof(Elf64_Rela) || r.sh_offset % 8 != 0 || !elf.in_bounds(r.sh_offset, r.sh_size))
      return decline("malformed relocation section");
    for (const Elf64_Rela& rel : std::span<const Elf64_Rela>(
             reinterpret_cast<const Elf64_Rela*>(elf.data + r.sh_offset), r.sh_size / sizeof(Elf64_Rela))) {
      const std::uint32_t sym = ELF64_R_SYM(rel.r_info), type = ELF64_R_TYPE(rel.r_info);
      if (sym >= elf.symbols.size()) return decline("relocation symbol out of range");
      if (type == R_X86_64_GOTPCREL || type == R_X86_64_GOTPCRELX || type == R_X86_64_REX_GOTPCRELX)
        got_slot.emplace(sym, got_slot.size());
      if (type == R_X86_64_PLT32 && elf.symbols[sym].st_shndx == SHN_UNDEF) {
        stub_slot.emplace(sym, stub_slot.size());
        got_slot.emplace(sym, got_slot.size());  // the stub jumps through the GOT
      }
    }
  }

  // 3. Layout: code, then the call stubs (reachable from the code with rel32), then from the next
  // page boundary the data sections and the GOT, so code and data never share a page.
  constexpr std::size_t kStub = 8;  // jmp *disp32(%rip) (6 bytes) + 2 bytes of int3
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::size_t> place(nsec, 0);
  std::size_t code_cursor = 0;
  for (std::size_t i = 0; i < nsec; ++i) {
    if (!loaded[i] || !(elf.sections[i].sh_flags & SHF_EXECINSTR)) continue;
    code_cursor = align_up(code_cursor, elf.sections[i].sh_addralign);
    place[i] = code_cursor;
    code_cursor += elf.sections[i].sh_size;
  }
  const std::size_t stubs_at = align_up(code_cursor, 16);
  const std::size_t data_at = align_up(stubs_at + stub_slot.size() * kStub, page);
  std::size_t data_cursor = data_at;
  for (std::size_t i = 0; i < nsec; ++i) {
    if (!loaded[i] || (elf.sections[i].sh_flags & SHF_EXECINSTR)) continue;
    data_cursor = align_up(data_cursor, elf.sections[i].sh_addralign);
    place[i] = data_cursor;
    data_cursor += elf.sections[i].sh_size;
  }
  const std::size_t got_at = align_up(data_cursor, 8);
  const std::size_t total = align_up(got_at + got_slot.size() * 8, page);

  void* mem = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return decline("mmap failed");
  auto object = std::make_unique<LoadedObject>(mem, total);
  auto* base = static_cast<unsigned char*>(mem);
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& s = elf.sections[i];
    if (!loaded[i]) continue;
    if (s.sh_type == SHT_NOBITS) continue;  // the mapping is zero-filled already
    std::memcpy(base + place[i], elf.data + s.sh_offset, s.sh_size);
  }

  // 4. Symbol addresses, the GOT and the stubs.
  auto symbol_address = [&](std::uint32_t index, std::uint64_t& out) -> bool {
    const Elf64_Sym& s = elf.symbols[index];
    if (s.st_shndx == SHN_UNDEF) {
      std::string_view name = elf.symbol_name(s);
      void* p = resolve(name);
      if (!p && ELF64_ST_BIND(s.st_info) != STB_WEAK) {
        result.error += fmt::format("{}Symbols not found: [ {} ]", result.error.empty() ? "" : "; ", name);
        return false;
      }
      out = reinterpret_cast<std::uintptr_t>(p);
      return true;
    }
    if (s.st_shndx == SHN_ABS) {
      out = s.st_value;
      return true;
    }
    if (s.st_shndx < nsec && loaded[s.st_shndx] && s.st_value > elf.sections[s.st_shndx].sh_size) {
      result.declined = "a symbol lies outside its section";
      return false;
    }
    if (s.st_shndx >= nsec || !loaded[s.st_shndx]) {
      result.declined = "a symbol in a section that is not loaded";
      return false;
    }
    out = reinterpret_cast<std::uintptr_t>(base + place[s.st_shndx]) + s.st_value;
    return true;
  };
  for (auto [sym, slot] : got_slot) {
    std::uint64_t addr = 0;
    if (!symbol_address(sym, addr)) continue;
    std::memcpy(base + got_at + slot * 8, &addr, 8);
  }
  for (auto [sym, slot] : stub_slot) {
    unsigned char* stub = base + stubs_at + slot * kStub;
    const std::int64_t disp = static_cast<std::int64_t>(got_at + got_slot.at(sym) * 8) -
                              static_cast<std::int64_t>(stubs_at + slot * kStub + 6);
    const std::int32_t d32 = static_cast<std::int32_t>(disp);
    stub[0] = 0xff;
    stub[1] = 0x25;
    std::memcpy(stub + 2, &d32, 4);
    stub[6] = stub[7] = 0xcc;
  }
  if (!result.error.empty()) {
    result.declined.clear();
    return result;
  }
  if (!result.declined.empty()) return result;

  // 5. Relocations.
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& r = elf.sections[i];
    if (r.sh_type != SHT_RELA || r.sh_info >= nsec || !loaded[r.sh_info]) continue;
    const Elf64_Shdr& target = elf.sections[r.sh_info];
    for (const Elf64_Rela& rel : std::span<const Elf64_Rela>(
             reinterpret_cast<const Elf64_Rela*>(elf.data + r.sh_offset), r.sh_size / sizeof(Elf64_Rela))) {
      const std::uint32_t sym = ELF64_R_SYM(rel.r_info), type = ELF64_R_TYPE(rel.r_info);
      if (rel.r_offset > target.sh_size || target.sh_size - rel.r_offset < 4)
        return decline("relocation outside its section");
      unsigned char* where = base + place[r.sh_info] + rel.r_offset;
      const std::int64_t P = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(where));
      const std::int64_t A = rel.r_addend;
      std::uint64_t S = 0;
      auto write32 = [&](std::int64_t v) -> bool {
        if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
          return false;
        const std::int32_t v32 = static_cast<std::int32_t>(v);
        std::memcpy(where, &v32, 4);
        return true;
      };
      switch (type) {
        case R_X86_64_NONE:
          break;
        case R_X86_64_64: {
          if (target.sh_size - rel.r_offset < 8) return decline("relocation outside its section");
          if (!symbol_address(sym, S)) return result;
          const std::uint64_t v = S + static_cast<std::uint64_t>(A);
          std::memcpy(where, &v, 8);
          break;
        }
        case R_X86_64_PC64: {
          if (target.sh_size - rel.r_offset < 8) return decline("relocation outside its section");
          if (!symbol_address(sym, S)) return result;
          const std::int64_t v = static_cast<std::int64_t>(S) + A - P;
          std::memcpy(where, &v, 8);
          break;
        }
        case R_X86_64_PC32:
        case R_X86_64_PLT32: {
          if (auto stub = stub_slot.find(sym); stub != stub_slot.end())
            S = reinterpret_cast<std::uintptr_t>(base + stubs_at + stub->second * kStub);
          else if (!symbol_address(sym, S))
            return result;
          if (!write32(static_cast<std::int64_t>(S) + A - P))
            return decline(fmt::format("a 32-bit PC-relative reference to '{}' is out of range",
                                       elf.symbol_name(elf.symbols[sym])));
          break;
        }
        case R_X86_64_GOTPCREL:
        case R_X86_64_GOTPCRELX:
        case R_X86_64_REX_GOTPCRELX: {
          const std::int64_t G =
              static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(base + got_at + got_slot.at(sym) * 8));
          if (!write32(G + A - P)) return decline("GOT out of range");
          break;
        }
        case R_X86_64_32:
        case R_X86_64_32S: {
          if (!symbol_address(sym, S)) return result;
          const std::int64_t v = static_cast<std::int64_t>(S) + A;
          if (type == R_X86_64_32 ? (v < 0 || v > 0xffffffffll) : !write32(v))
            return decline("a 32-bit absolute reference out of range (object not built -fPIC)");
          if (type == R_X86_64_32) {
            const std::uint32_t v32 = static_cast<std::uint32_t>(v);
            std::memcpy(where, &v32, 4);
          }
          break;
        }
        default:
          return decline(fmt::format("relocation type {} is not handled by the fast loader", type));
      }
    }
  }

  // 6. Seal: code read+execute, the rest stays read+write.
  if (data_at > 0 && ::mprotect(base, data_at, PROT_READ | PROT_EXEC) != 0) return decline("mprotect failed");
  for (const Elf64_Sym& s : elf.symbols) {
    if (ELF64_ST_TYPE(s.st_info) != STT_FUNC || s.st_shndx == SHN_UNDEF || s.st_shndx >= nsec ||
        !loaded[s.st_shndx] || elf.symbol_name(s) != function)
      continue;
    if (s.st_value >= elf.sections[s.st_shndx].sh_size) return decline("the function's address lies outside its section");
    object->entry = base + place[s.st_shndx] + s.st_value;
  }
  if (!object->entry) return decline(fmt::format("function '{}' not found", function));
  result.object = std::move(object);
  return result;
}

}  // namespace tinydev::cpu
