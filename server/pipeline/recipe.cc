#include "server/pipeline/recipe.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/excerpt.h"

namespace quantd::pipeline {

using checkpoint::LeafName;
using checkpoint::LinearModule;
using checkpoint::ModelArch;
using checkpoint::ModuleOf;
using checkpoint::NaturalLess;
using checkpoint::TensorInventory;

bool GlobMatch(absl::string_view pattern, absl::string_view name) {
  size_t p = 0, n = 0;
  size_t star = absl::string_view::npos, star_n = 0;  // last '*' and where its match ends
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (star != absl::string_view::npos) {  // let the last '*' swallow one more char
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

namespace {

RecipeRule Exclude(std::string glob, std::string reason) {
  return {std::move(glob), false, std::move(reason)};
}
RecipeRule Include(std::string glob) { return {std::move(glob), true, ""}; }

}  // namespace

const std::vector<std::vector<std::string>>& FusedSets() {
  static const std::vector<std::vector<std::string>> kSets = {
      {"w1", "w3"},
      {"gate_proj", "up_proj"},
      {"wq_a", "wkv"},
      {"q_a_proj", "kv_a_proj_with_mqa"},
      {"q_proj", "k_proj", "v_proj"},
  };
  return kSets;
}

absl::StatusOr<Recipe> BuiltinRecipe(absl::string_view name, const TensorInventory& inv,
                                     int revision) {
  Recipe r;
  r.name = std::string(name);
  if (name != "experts" && name != "full") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown recipe '", name, "' (expected experts or full)"));
  }
  if (revision < 1 || revision > job::kRecipeRevision) {
    return absl::InvalidArgumentError(absl::StrCat("unknown recipe revision ", revision,
                                                   " (expected 1 to ", job::kRecipeRevision, ")"));
  }
  const bool experts = name == "experts";
  if (inv.arch == ModelArch::kDeepseekV4) {
    if (experts) {
      r.rules = {Exclude("*.attn.*", "attention"), Exclude("*.ffn.shared_experts.*", "shared expert"),
                 Exclude("head", "head"), Exclude("mtp.*", "mtp"),
                 Include("layers.*.ffn.experts.*")};
    } else {
      r.rules = {Exclude("mtp.*", "mtp"),
                 Exclude("embed", "embedding"),
                 Exclude("head", "head"),
                 Exclude("*.ffn.gate", "router gate"),
                 Exclude("*.attn.compressor.*", "compressor"),
                 Exclude("*.attn.indexer.*", "indexer")};
      if (revision >= 2) {
        r.rules.push_back(Exclude(kGroupedOutputProjectionGlob, "grouped output projection"));
      }
      r.rules.insert(r.rules.end(), {Include("layers.*.attn.*"),
                                     Include("layers.*.ffn.shared_experts.*"),
                                     Include("layers.*.ffn.experts.*")});
    }
    return r;
  }
  if (inv.arch == ModelArch::kDeepseekV3) {
    if (inv.num_hidden_layers <= 0) {
      return absl::FailedPreconditionError(
          "deepseek_v3 recipes need num_hidden_layers in config.json (the MTP layer's index)");
    }
    const std::string mtp = absl::StrCat("model.layers.", inv.num_hidden_layers, ".*");
    if (experts) {
      r.rules = {Exclude(mtp, "mtp"), Exclude("*.self_attn.*", "attention"),
                 Exclude("*.mlp.shared_experts.*", "shared expert"), Exclude("lm_head", "head"),
                 Include("model.layers.*.mlp.experts.*")};
    } else {
      r.rules = {Exclude(mtp, "mtp"),
                 Exclude("model.embed_tokens", "embedding"),
                 Exclude("lm_head", "head"),
                 Exclude("*.mlp.gate", "router gate"),
                 Include("model.layers.*.self_attn.*"),
                 Include("model.layers.*.mlp.*")};
    }
    return r;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("recipe '", name,
                   "' is defined for deepseek_v4 and deepseek_v3 checkpoints; "
                   "this one has model_type ",
                   base::Excerpt(inv.model_type), " (use include/exclude globs)"));
}

Recipe GlobRecipe(const std::vector<std::string>& include, const std::vector<std::string>& exclude) {
  Recipe r;
  r.name = "globs";
  for (const std::string& g : exclude) r.rules.push_back(Exclude(g, absl::StrCat("exclude ", g)));
  for (const std::string& g : include) r.rules.push_back(Include(g));
  return r;
}

absl::StatusOr<RecipePlan> PlanRecipe(const TensorInventory& inv, const Recipe& recipe) {
  RecipePlan plan;
  std::set<std::string> selected;
  for (const LinearModule& m : inv.linears) {
    const RecipeRule* rule = nullptr;
    for (const RecipeRule& r : recipe.rules) {
      if (GlobMatch(r.glob, m.name)) {
        rule = &r;
        break;
      }
    }
    if (rule != nullptr && rule->include) {
      plan.modules.push_back(m.name);
      plan.bytes += m.bytes;
      selected.insert(m.name);
    } else {
      ++plan.excluded[rule != nullptr ? rule->reason : "not selected"];
    }
  }

  // (parent, fused set) -> members present, in the set's order.
  std::map<std::pair<std::string, size_t>, std::vector<std::string>> sets;
  for (const LinearModule& m : inv.linears) {
    const std::string parent = ModuleOf(m.name);
    const std::string leaf = LeafName(m.name);
    for (size_t k = 0; k < FusedSets().size(); ++k) {
      const std::vector<std::string>& set = FusedSets()[k];
      if (std::find(set.begin(), set.end(), leaf) != set.end()) sets[{parent, k}].push_back(m.name);
    }
  }
  for (auto& [key, members] : sets) {
    const std::vector<std::string>& order = FusedSets()[key.second];
    std::sort(members.begin(), members.end(), [&](const std::string& a, const std::string& b) {
      const auto leaf_pos = [&](const std::string& s) {
        return std::find(order.begin(), order.end(), LeafName(s)) - order.begin();
      };
      return leaf_pos(a) < leaf_pos(b);
    });
    std::vector<std::string> in, out;
    for (const std::string& m : members) (selected.count(m) > 0 ? in : out).push_back(m);
    if (!in.empty() && !out.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "recipe '", recipe.name, "' quantizes ", absl::StrJoin(in, ", "),
          " but not its fused partner(s) ", absl::StrJoin(out, ", "),
          "; fused modules must be quantized together"));
    }
    if (in.size() >= 2) plan.fusion_groups.push_back(std::move(in));
  }
  std::sort(plan.fusion_groups.begin(), plan.fusion_groups.end(),
            [](const std::vector<std::string>& a, const std::vector<std::string>& b) {
              return NaturalLess(a.front(), b.front());
            });
  return plan;
}

}  // namespace quantd::pipeline
