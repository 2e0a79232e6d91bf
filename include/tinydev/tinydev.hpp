// tinydev/tinydev.hpp: the umbrella header. Include this to get every public name of tinydev.
#pragma once

#include "tinydev/buffer.hpp"
#include "tinydev/compile.hpp"
#include "tinydev/cpu/thread_pool.hpp"  // CpuThreadPool: the CPU backends' workers
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/dtype.hpp"
#include "tinydev/error.hpp"
#include "tinydev/graph.hpp"
#include "tinydev/hcq.hpp"
#include "tinydev/hcq_graph.hpp"
#include "tinydev/log.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/profile.hpp"
#include "tinydev/registry.hpp"
#include "tinydev/safetensors.hpp"
#include "tinydev/signal.hpp"
#include "tinydev/version.hpp"
