// tinydev/hcq.hpp: the hardware-command-queue layer (layer 5), everything at once. docs/hcq.md
// explains the layer and how to write an HCQ backend.
//
//  - tinydev/hcq_queue.hpp      command queues (CRTP templates over a backend's primitives)
//  - tinydev/hcq_device.hpp     HCQCompiled: timeline, signals, profiling scopes
//  - tinydev/hcq_allocator.hpp  HCQAllocator: caching allocator, staging ring, transfers
//  - tinydev/hcq_concepts.hpp   the contract a backend's queues, programs and device satisfy
#pragma once

#include "tinydev/hcq_allocator.hpp"
#include "tinydev/hcq_concepts.hpp"
#include "tinydev/hcq_device.hpp"
#include "tinydev/hcq_queue.hpp"
