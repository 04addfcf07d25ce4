// Every protocol header at once.
#pragma once
#include "comm_schedule.hpp"
#include "epoch.hpp"
#include "fn.hpp"
#include "layout.hpp"
#include "ownership.hpp"
#include "partition.hpp"
#include "row_chunks.hpp"
#include "swizzle.hpp"
#include "tile_plan.hpp"
