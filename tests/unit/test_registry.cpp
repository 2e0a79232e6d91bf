#include <algorithm>
#include <utility>
#include <thread>

#include "support.hpp"

using namespace tinydev;
using namespace tinydev::testing;

TEST_CASE("registry: an unknown device lists the backends this build has", "[registry]") {
  register_fakes();
  CHECK_THROWS_AS(Device["nosuchdev"], InvalidArgument);
  CHECK_THROWS_WITH(Device["nosuchdev:1"], Catch::Contains("unknown device 'nosuchdev:1'") &&
                                                 Catch::Contains("FAKE"));
  CHECK_THROWS_AS(Device[""], InvalidArgument);
}

TEST_CASE("registry: one instance per canonical name", "[registry]") {
  Compiled& a = fake_device("fake");
  CHECK(&Device["FAKE"] == &a);
  CHECK(&Device["fake:0"] == &a);
  CHECK(a.name() == "FAKE");
  Compiled& b = Device["fake:1"];
  CHECK(&b != &a);
  CHECK(b.name() == "FAKE:1");
  auto opened = Device.opened();
  CHECK(std::find(opened.begin(), opened.end(), "FAKE:1") != opened.end());
}

TEST_CASE("registry: 16 threads opening the same device get one instance - built once", "[registry]") {
  static std::atomic<int> builds{0};
  static std::atomic<bool> go{false};
  Device.register_backend("SLOWOPEN", [](const std::string& name) {
    builds++;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // widen the race window
    return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>());
  });
  std::vector<Compiled*> seen(16, nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i)
    threads.emplace_back([&, i] {
      while (!go) std::this_thread::yield();
      seen[i] = &Device[i % 2 ? "slowopen" : "SLOWOPEN:0"];
    });
  go = true;
  for (auto& t : threads) t.join();
  CHECK(builds == 1);
  for (Compiled* p : seen) CHECK(p == seen[0]);
}

TEST_CASE("registry: a failed open is an error and is retried next time", "[registry]") {
  static int attempts = 0;
  Device.register_backend("FLAKY", [](const std::string& name) -> std::unique_ptr<Compiled> {
    if (++attempts == 1) throw DeviceUnavailable("FLAKY: the driver is not loaded");
    return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>());
  });
  CHECK_THROWS_WITH(Device["flaky"], Catch::Contains("driver is not loaded"));
  CHECK(Device["flaky"].name() == "FLAKY");
  CHECK(attempts == 2);
}

TEST_CASE("registry: backend names are validated and unique", "[registry]") {
  register_fakes();
  auto factory = [](const std::string& n) {
    return std::make_unique<FakeDevice>(n, std::make_shared<FakeAllocator>());
  };
  CHECK_THROWS_WITH(Device.register_backend("FAKE", factory), Catch::Contains("already registered"));
  CHECK_THROWS_AS(Device.register_backend("lower", factory), InvalidArgument);
  CHECK_THROWS_AS(Device.register_backend("HAS:COLON", factory), InvalidArgument);
}

TEST_CASE("registry: the default device comes from TINYDEV_DEVICE", "[registry]") {
  {
    ScopedOverride dev("TINYDEV_DEVICE", "fake:3");
    CHECK(Device.default_device() == "FAKE:3");
  }
  ::setenv("TINYDEV_DEVICE", "fake:0", 1);
  reload_environment();
  CHECK(Device.default_device() == "FAKE");
  ::unsetenv("TINYDEV_DEVICE");
  reload_environment();
}

TEST_CASE("registry: with no usable backend - the default device error says why for each", "[registry]") {
  // This test binary links tinydev_core alone: no CUDA, LLVM or CLANG in it.
  ScopedOverride dev("TINYDEV_DEVICE", std::nullopt);
  CHECK_THROWS_AS(Device.default_device(), DeviceUnavailable);
  CHECK_THROWS_WITH(Device.default_device(), Catch::Contains("no usable devices") &&
                                                 Catch::Contains("CUDA: not in this build") &&
                                                 Catch::Contains("LLVM: not in this build") &&
                                                 Catch::Contains("CLANG: not in this build"));
}

TEST_CASE("registry: available lists the backends whose first device opens and says nothing of the rest", "[registry]") {
  register_fakes();
  const std::string tag = std::to_string(fresh_seed() % 100000);
  const std::string works = "AVAILOK" + tag, broken = "AVAILNO" + tag;
  Device.register_backend(works, [](const std::string& name) -> std::unique_ptr<Compiled> {
    return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>());
  });
  Device.register_backend(broken, [](const std::string&) -> std::unique_ptr<Compiled> {
    throw DeviceUnavailable("no driver");
  });
  const std::vector<std::string> available = Device.available();
  CHECK(std::find(available.begin(), available.end(), works) != available.end());
  CHECK(std::find(available.begin(), available.end(), broken) == available.end());
  CHECK(std::find(available.begin(), available.end(), "FAKE") != available.end());
  // In backend order, each at most once.
  std::vector<std::string> sorted = available;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
}

namespace {
// A device without a timeline whose pending work can fail while synchronize() drains it: what the
// default Compiled::record sees on a backend that keeps no Events of its own.
class DrainingDevice final : public Compiled {
 public:
  explicit DrainingDevice(const std::string& name)
      : Compiled(name, std::make_shared<FakeAllocator>(), std::make_unique<FakeCompiler>(), nullptr,
                 SourceLanguage::None) {}
  void synchronize() override {
    ++synchronizes;
    if (pending_fails) fault_ = "kernel 'k' failed: fake launch failure";
    pending_fails = false;
  }
  std::string fault() const override { return fault_; }
  std::string recover(std::chrono::milliseconds) override { return std::exchange(fault_, {}); }
  int synchronizes = 0;
  bool pending_fails = false;

 private:
  std::string fault_;
};
}  // namespace

TEST_CASE("registry: the default Compiled::record drains the device and reports a fault that drain found",
          "[registry]") {
  DrainingDevice dev("DRAIN:" + std::to_string(fresh_seed() % 1000));
  const Event done = dev.record();
  CHECK(dev.synchronizes == 1);
  CHECK(done.query());
  CHECK_FALSE(done.signal().valid());  // complete from the start: no signal to outlive the device

  // The work queued before record() fails while it drains: the fault is reported, not a success.
  dev.pending_fails = true;
  CHECK_THROWS_AS(dev.record(), DeviceFault);
  CHECK(dev.synchronizes == 2);
  CHECK_THROWS_WITH(dev.record(), Catch::Contains(dev.name()) && Catch::Contains("fake launch failure") &&
                                      Catch::Contains("recover()"));
  CHECK(dev.recover(std::chrono::seconds(1)) == "kernel 'k' failed: fake launch failure");
  CHECK(dev.record().query());
}
