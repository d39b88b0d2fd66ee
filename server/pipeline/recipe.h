// Recipes: which linear modules of a checkpoint a job quantizes, and which of them must share
// scales because readers fuse them into one GEMM (DESIGN.md "Export rules").
//
// A recipe is an ordered list of rules over module names; the first rule whose glob matches a
// module decides, and a module no rule matches is left alone ("not selected"). Built-in recipes:
//   experts  NVIDIA's DeepSeek-V4 recipe: routed experts of the main layers only. V4 excludes
//            `*.attn.*`, `*.ffn.shared_experts.*`, `head`, `mtp.*` (the published exclude_modules)
//            and includes `layers.*.ffn.experts.*`; V3 likewise excludes `*.self_attn.*`,
//            `*.mlp.shared_experts.*`, `lm_head` and the MTP layer `model.layers.<L>.*`
//            (L = num_hidden_layers) and includes `model.layers.*.mlp.experts.*`.
//   full     every linear of attention, shared and routed experts (V3: and the dense MLPs);
//            excluded: MTP, embeddings, head, router gate, compressor and indexer projections,
//            and (V4) the grouped output projection `*.attn.wo_a`: vLLM, SGLang and TensorRT-LLM
//            run it only as an FP8 / BF16 grouped product (einsum / BMM), never as NVFP4 W4A4, so
//            it keeps its source format rather than ship an input_scale no runtime uses.
//            (Norms and hc_* parameters are not linear modules and are never candidates.)
// Revisions (job::kRecipeRevision is the current one; a job keeps the one it was planned with):
//   1  V4 `full` also quantizes `*.attn.wo_a` (releases before issue 23);
//   2  V4 `full` leaves `*.attn.wo_a` in its source format.
//   globs    explicit lists: quantized iff a module matches an include glob and no exclude glob.
// Globs are fnmatch-style over whole module names: '*' matches any run of characters, dots
// included; '?' matches one character.
#ifndef QUANTD_SERVER_PIPELINE_RECIPE_H_
#define QUANTD_SERVER_PIPELINE_RECIPE_H_

#include <stdint.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/job/job_spec.h"

namespace quantd::pipeline {

struct RecipeRule {
  std::string glob;    // over module names
  bool include;        // quantize (true) or keep in the source format (false)
  std::string reason;  // exclude rules: why, as inspect reports it
};

struct Recipe {
  std::string name;               // "experts", "full" or "globs"
  std::vector<RecipeRule> rules;  // first match decides
};

bool GlobMatch(absl::string_view pattern, absl::string_view name);

// DeepSeek-V4's grouped output projection, which no runtime runs as W4A4 (above): the `full`
// recipe's exclusion from revision 2 on, the planner's refusal of a W4A4 selection of it, and
// the test that a stored plan was made at revision 1.
inline constexpr char kGroupedOutputProjectionGlob[] = "*.attn.wo_a";
inline bool IsGroupedOutputProjection(absl::string_view module) {
  return GlobMatch(kGroupedOutputProjectionGlob, module);
}

// Sibling leaf names that readers fuse into one GEMM when they share a parent module
// ({"w1","w3"}, {"gate_proj","up_proj"}, {"wq_a","wkv"}, {"q_a_proj","kv_a_proj_with_mqa"},
// {"q_proj","k_proj","v_proj"}), members in reader order.
const std::vector<std::vector<std::string>>& FusedSets();

// "experts" or "full" for the inventory's architecture (deepseek_v4 or deepseek_v3; other
// architectures have no built-in recipe), as of recipe revision `revision` (1 or 2, above).
absl::StatusOr<Recipe> BuiltinRecipe(absl::string_view name,
                                     const checkpoint::TensorInventory& inventory,
                                     int revision = job::kRecipeRevision);
// Exclude globs win over include globs; the reason of an exclusion is "exclude <glob>".
Recipe GlobRecipe(const std::vector<std::string>& include, const std::vector<std::string>& exclude);

struct RecipePlan {
  std::vector<std::string> modules;                     // quantized modules, natural order
  std::vector<std::vector<std::string>> fusion_groups;  // modules that share scales
  uint64_t bytes = 0;                                   // source bytes of `modules` (with scales)
  std::map<std::string, int64_t> excluded;              // reason -> linear modules left alone
};

// Applies `recipe` to every linear module. Fusion groups are the quantized siblings {w1, w3},
// {gate_proj, up_proj}, {wq_a, wkv}, {q_a_proj, kv_a_proj_with_mqa} and {q_proj, k_proj, v_proj}
// under one parent, members in that order, groups in natural order. Fails when a recipe
// quantizes one member of such a set but not another that exists.
absl::StatusOr<RecipePlan> PlanRecipe(const checkpoint::TensorInventory& inventory,
                                      const Recipe& recipe);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_RECIPE_H_
