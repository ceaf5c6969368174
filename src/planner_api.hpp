// Between the planner's internal types (plan.hpp) and the public ones
// (ferry/save_plan.hpp), and the byte form in which rank 0 sends every rank's
// plan to every rank of a save driven in steps.
#pragma once

#include <string>
#include <vector>

#include "data_files.hpp"
#include "ferry/save_plan.hpp"
#include "plan.hpp"

namespace ferry {

LocalSavePlan to_public(const LocalPlan& p);
LocalPlan to_internal(const LocalSavePlan& p);

// Every rank's SavePlan from the local plans and the global plan made of
// them; `files[r]` shapes rank r's data files (data_files(), as its writers
// will): its writes are the pieces of those files, in their order.
Result<std::vector<SavePlan>> save_plans(const std::vector<LocalPlan>& locals, const GlobalPlan& gp,
                                         const std::vector<DataFileOptions>& files);

std::string encode_save_plans(const std::vector<SavePlan>& plans);
Result<std::vector<SavePlan>> decode_save_plans(const std::string& bytes);

// A transformed local plan against the one it came from: items may be
// dropped or renamed, nothing else (the error names the item).
Status check_transformed(const LocalPlan& original, const LocalSavePlan& transformed);

}  // namespace ferry
