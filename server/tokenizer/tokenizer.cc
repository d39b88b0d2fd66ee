#include "server/tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/base/utf8.h"
#include "server/checkpoint/atomic_file.h"
#include "server/tokenizer/tokenizer_added_tokens.h"
#include "server/tokenizer/tokenizer_bpe.h"
#include "server/tokenizer/tokenizer_byte_level.h"
#include "server/tokenizer/tokenizer_regex.h"

namespace quantd::tokenizer {

using base::AppendUtf8;
using base::FirstInvalidUtf8;
using base::Utf8Lossy;

namespace {

using nlohmann::json;

// Bounds on what a tokenizer.json may hold, so that a hostile file cannot make loading or
// encoding take unbounded memory or time. DeepSeek-V3's file: ids to 128814, 127741 merges, 818
// added tokens, about 0.6 million JSON values, no normalizer step, 4 pre-tokenizer steps.
// Token ids above this are refused (the id tables take 40 bytes per id up to the largest).
constexpr int64_t kMaxTokenId = (int64_t{1} << 20) - 1;
constexpr size_t kMaxVocabEntries = size_t{1} << 20;
constexpr size_t kMaxMerges = size_t{1} << 20;
constexpr size_t kMaxAddedTokens = size_t{1} << 16;
constexpr size_t kMaxAddedTokenBytes = size_t{1} << 20;  // all contents together
// JSON values in the whole file (each takes tens of bytes once parsed) and nesting depth.
constexpr size_t kMaxJsonValues = size_t{4} << 20;
constexpr size_t kMaxJsonDepth = 64;
// Steps of the normalizer and of the pre-tokenizer, after Sequences are flattened.
constexpr size_t kMaxSteps = 64;
// The normalizer may make a text at most this many times longer (plus kNormalizeSlackBytes, for
// a Prepend on a short piece); more is an error, not an allocation.
constexpr size_t kMaxNormalizeGrowth = 4;
constexpr size_t kNormalizeSlackBytes = 1024;

// The GPT-2 pattern the ByteLevel pre-tokenizer applies when its use_regex is true.
constexpr absl::string_view kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One pre-tokenizer step. ByteLevel's byte mapping itself is implicit (BPE runs on bytes).
struct PreTokenizeStep {
  enum class Kind { kSplit, kPrefixSpace } kind = Kind::kSplit;
  std::optional<TokenizerRegex> regex;  // kSplit
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

struct NormalizeStep {
  enum class Kind { kPrepend, kReplace } kind = Kind::kPrepend;
  std::string text;         // kPrepend: the prefix; kReplace: the string replaced
  std::string replacement;  // kReplace
  std::string field;        // where it is in the file, for errors
};

// Counts the values and the depth of a JSON text without building it (nlohmann's SAX interface),
// so that a file of millions of tiny values is refused before it takes gigabytes as a DOM.
class JsonShape : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(size_t) override { return Open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return Close(); }
  bool start_array(size_t) override { return Open(); }
  bool end_array() override { return Close(); }
  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception&) override {
    invalid = true;
    return false;
  }

  bool invalid = false;
  bool too_many = false;
  bool too_deep = false;

 private:
  bool Value() {
    too_many = ++values_ > kMaxJsonValues;
    return !too_many;
  }
  bool Open() {
    too_deep = ++depth_ > kMaxJsonDepth;
    return Value() && !too_deep;
  }
  bool Close() {
    --depth_;
    return true;
  }
  size_t values_ = 0;
  size_t depth_ = 0;
};

enum class JsonKind { kObject, kArray, kString, kBool, kInteger };

const char* KindName(JsonKind kind) {
  switch (kind) {
    case JsonKind::kObject:
      return "an object";
    case JsonKind::kArray:
      return "an array";
    case JsonKind::kString:
      return "a string";
    case JsonKind::kBool:
      return "true or false";
    case JsonKind::kInteger:
      return "an integer";
  }
  return "";
}

bool IsKind(const json& v, JsonKind kind) {
  switch (kind) {
    case JsonKind::kObject:
      return v.is_object();
    case JsonKind::kArray:
      return v.is_array();
    case JsonKind::kString:
      return v.is_string();
    case JsonKind::kBool:
      return v.is_boolean();
    case JsonKind::kInteger:
      return v.is_number_integer();
  }
  return false;
}

// Reads tokenizer.json, naming the field (a path like 'pre_tokenizer.pretokenizers[2].pattern')
// in every error.
class Reader {
 public:
  explicit Reader(std::string origin) : origin_(std::move(origin)) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": field '", field, "' ", what));
  }

  static std::string Path(absl::string_view parent, absl::string_view key) {
    return parent.empty() ? std::string(key) : absl::StrCat(parent, ".", key);
  }
  static std::string Index(absl::string_view parent, size_t i) { return absl::StrCat(parent, "[", i, "]"); }

  // The member `key` of object `parent` (at `path`), or nullptr when it is absent or null and
  // not `required`.
  absl::StatusOr<const json*> Get(const json& parent, absl::string_view path, absl::string_view key,
                                  JsonKind kind, bool required) const {
    const std::string field = Path(path, key);
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) {
      if (required) return Error(field, "is required");
      return nullptr;
    }
    if (!IsKind(*it, kind)) return Error(field, absl::StrCat("must be ", KindName(kind)));
    return &*it;
  }

  absl::StatusOr<std::string> String(const json& parent, absl::string_view path,
                                     absl::string_view key) const {
    ASSIGN_OR_RETURN(const json* v, Get(parent, path, key, JsonKind::kString, true));
    return v->get<std::string>();
  }

  absl::StatusOr<bool> Bool(const json& parent, absl::string_view path, absl::string_view key,
                            bool default_value) const {
    ASSIGN_OR_RETURN(const json* v, Get(parent, path, key, JsonKind::kBool, false));
    return v == nullptr ? default_value : v->get<bool>();
  }

  absl::StatusOr<int32_t> TokenIdValue(const json& v, absl::string_view field) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTokenId) {
      return Error(field, absl::StrCat("must be a token id from 0 to ", kMaxTokenId));
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

  // The "type" of the component object at `path`.
  absl::StatusOr<std::string> Type(const json& component, absl::string_view path) const {
    return String(component, path, "type");
  }

  absl::Status Unsupported(absl::string_view path, absl::string_view type,
                           absl::string_view supported) const {
    return Error(Path(path, "type"), absl::StrCat("has unsupported type ", base::Excerpt(type, 64),
                                                  " (quantd reads ", supported, ")"));
  }

  // More than `cap` entries in the array or object at `field`.
  absl::Status TooMany(absl::string_view field, size_t size, size_t cap) const {
    return Error(field, absl::StrCat("has ", size, " entries; quantd reads at most ", cap));
  }

  // How errors name a field: "FILE: field 'FIELD'".
  std::string Where(absl::string_view field) const {
    return absl::StrCat(origin_, ": field '", field, "'");
  }

 private:
  std::string origin_;  // file name for errors
};

// Split behaviours by their tokenizer.json names.
constexpr std::pair<absl::string_view, SplitBehavior> kBehaviors[] = {
    {"Removed", SplitBehavior::kRemoved},
    {"Isolated", SplitBehavior::kIsolated},
    {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
    {"MergedWithNext", SplitBehavior::kMergedWithNext},
    {"Contiguous", SplitBehavior::kContiguous},
};

}  // namespace

struct Tokenizer::Impl {
  AddedTokenMatcher raw_added;         // added tokens with normalized == false
  AddedTokenMatcher normalized_added;  // added tokens with normalized == true
  std::vector<NormalizeStep> normalizer;
  std::vector<PreTokenizeStep> pre_tokenizer;
  std::unique_ptr<BpeModel> bpe;
  std::vector<int32_t> post_prefix;  // the post-processor's ids before the sequence
  std::vector<int32_t> post_suffix;  // and after it
  bool byte_level_decoder = false;   // the decoder is ByteLevel (the only one Decode knows)
  std::vector<std::string> id_bytes;  // id -> the bytes it decodes to
  std::vector<bool> has_token;        // id -> whether the id has a token
  absl::flat_hash_map<std::string, int32_t> token_ids;  // spelling -> id (added tokens win)
  std::optional<int32_t> bos;
  std::string origin;  // the file, for errors

  // Loading: the "model" object (vocabulary, merges) and the "added_tokens" array.
  absl::Status ParseModel(const Reader& r, const json& doc);
  absl::Status ParseAddedTokens(const Reader& r, const json& doc);

  // Encoding state: the text's deadline and the thread's regex scratch.
  struct Encoding {
    TextBudget budget;
    RegexScratch scratch;
  };
  absl::Status EncodeRaw(absl::string_view text, Encoding& e, std::vector<int32_t>* out) const;
  absl::Status EncodeNormalizable(absl::string_view piece, Encoding& e,
                                  std::vector<int32_t>* out) const;
  absl::Status PreTokenize(absl::string_view piece, size_t step, Encoding& e,
                           std::vector<int32_t>* out) const;
  absl::StatusOr<std::string> Normalize(absl::string_view piece) const;

  void SetToken(int32_t id, absl::string_view spelling) {
    if (static_cast<size_t>(id) >= has_token.size()) {
      has_token.resize(id + 1, false);
      id_bytes.resize(id + 1);
    }
    has_token[id] = true;
    // As the ByteLevel decoder: a token outside the byte alphabet stands for its own UTF-8.
    std::optional<std::string> bytes = ByteLevelToBytes(spelling);
    id_bytes[id] = bytes ? *std::move(bytes) : std::string(spelling);
  }
};

namespace {

absl::Status ParseNormalizer(const Reader& r, const json& n, const std::string& path,
                             std::vector<NormalizeStep>* steps) {
  if (!n.is_object()) return r.Error(path, "must be an object or null");
  ASSIGN_OR_RETURN(std::string type, r.Type(n, path));
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const json* list, r.Get(n, path, "normalizers", JsonKind::kArray, true));
    const std::string list_path = Reader::Path(path, "normalizers");
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParseNormalizer(r, (*list)[i], Reader::Index(list_path, i), steps));
    }
    return absl::OkStatus();
  }
  if (type == "Prepend") {
    ASSIGN_OR_RETURN(std::string prefix, r.String(n, path, "prepend"));
    steps->push_back({NormalizeStep::Kind::kPrepend, std::move(prefix), "", path});
    return absl::OkStatus();
  }
  if (type == "Replace") {
    ASSIGN_OR_RETURN(const json* pattern, r.Get(n, path, "pattern", JsonKind::kObject, true));
    const std::string pattern_path = Reader::Path(path, "pattern");
    ASSIGN_OR_RETURN(const json* s, r.Get(*pattern, pattern_path, "String", JsonKind::kString, true));
    ASSIGN_OR_RETURN(std::string content, r.String(n, path, "content"));
    if (s->get<std::string>().empty()) return r.Error(Reader::Path(pattern_path, "String"), "must not be empty");
    steps->push_back({NormalizeStep::Kind::kReplace, s->get<std::string>(), std::move(content), path});
    return absl::OkStatus();
  }
  return r.Unsupported(path, type, "Sequence, Prepend and Replace with a String pattern");
}

// Appends the steps of pre-tokenizer `p`; `byte_level` counts ByteLevel steps seen.
absl::Status ParsePreTokenizer(const Reader& r, const json& p, const std::string& path,
                               std::vector<PreTokenizeStep>* steps, int* byte_level) {
  if (!p.is_object()) return r.Error(path, "must be an object");
  ASSIGN_OR_RETURN(std::string type, r.Type(p, path));
  if (*byte_level > 0) {
    return r.Error(path, "follows the ByteLevel pre-tokenizer (quantd needs ByteLevel last)");
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const json* list, r.Get(p, path, "pretokenizers", JsonKind::kArray, true));
    const std::string list_path = Reader::Path(path, "pretokenizers");
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParsePreTokenizer(r, (*list)[i], Reader::Index(list_path, i), steps, byte_level));
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    PreTokenizeStep step;
    ASSIGN_OR_RETURN(const json* pattern, r.Get(p, path, "pattern", JsonKind::kObject, true));
    const std::string pattern_path = Reader::Path(path, "pattern");
    ASSIGN_OR_RETURN(const json* regex, r.Get(*pattern, pattern_path, "Regex", JsonKind::kString, false));
    ASSIGN_OR_RETURN(const json* literal, r.Get(*pattern, pattern_path, "String", JsonKind::kString, false));
    if ((regex == nullptr) == (literal == nullptr)) {
      return r.Error(pattern_path, "must have exactly one of 'Regex' and 'String'");
    }
    const std::string field = Reader::Path(pattern_path, regex ? "Regex" : "String");
    absl::StatusOr<TokenizerRegex> compiled = TokenizerRegex::Compile(
        (regex ? regex : literal)->get<std::string>(), literal != nullptr, r.Where(field));
    if (!compiled.ok()) return r.Error(field, compiled.status().message());
    step.regex = *std::move(compiled);
    ASSIGN_OR_RETURN(std::string behavior, r.String(p, path, "behavior"));
    auto it = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                           [&](const auto& b) { return b.first == behavior; });
    if (it == std::end(kBehaviors)) {
      return r.Error(Reader::Path(path, "behavior"),
                     "must be one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
    }
    step.behavior = it->second;
    ASSIGN_OR_RETURN(step.invert, r.Bool(p, path, "invert", false));
    steps->push_back(std::move(step));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    ++*byte_level;
    ASSIGN_OR_RETURN(bool add_prefix_space, r.Bool(p, path, "add_prefix_space", true));
    ASSIGN_OR_RETURN(bool use_regex, r.Bool(p, path, "use_regex", true));
    if (add_prefix_space) steps->push_back({PreTokenizeStep::Kind::kPrefixSpace, std::nullopt});
    if (use_regex) {
      ASSIGN_OR_RETURN(TokenizerRegex gpt2, TokenizerRegex::Compile(kByteLevelPattern, false, r.Where(path)));
      PreTokenizeStep step;
      step.regex = std::move(gpt2);
      steps->push_back(std::move(step));
    }
    return absl::OkStatus();
  }
  return r.Unsupported(path, type, "Sequence, Split and ByteLevel");
}

absl::Status ParsePostProcessor(const Reader& r, const json& p, const std::string& path,
                                std::vector<int32_t>* prefix, std::vector<int32_t>* suffix) {
  if (!p.is_object()) return r.Error(path, "must be an object or null");
  ASSIGN_OR_RETURN(std::string type, r.Type(p, path));
  if (type == "ByteLevel") return absl::OkStatus();  // adjusts offsets only
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const json* list, r.Get(p, path, "processors", JsonKind::kArray, true));
    const std::string list_path = Reader::Path(path, "processors");
    for (size_t i = 0; i < list->size(); ++i) {
      std::vector<int32_t> pre, post;
      RETURN_IF_ERROR(ParsePostProcessor(r, (*list)[i], Reader::Index(list_path, i), &pre, &post));
      // Each processor wraps what the previous ones produced.
      prefix->insert(prefix->begin(), pre.begin(), pre.end());
      suffix->insert(suffix->end(), post.begin(), post.end());
    }
    return absl::OkStatus();
  }
  if (type != "TemplateProcessing") {
    return r.Unsupported(path, type, "TemplateProcessing, ByteLevel and Sequence");
  }
  ASSIGN_OR_RETURN(const json* single, r.Get(p, path, "single", JsonKind::kArray, true));
  ASSIGN_OR_RETURN(const json* specials, r.Get(p, path, "special_tokens", JsonKind::kObject, false));
  const std::string single_path = Reader::Path(path, "single");
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const json& item = (*single)[i];
    const std::string item_path = Reader::Index(single_path, i);
    if (!item.is_object() || item.size() != 1) {
      return r.Error(item_path, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    if (item.contains("Sequence")) {
      ASSIGN_OR_RETURN(const json* seq, r.Get(item, item_path, "Sequence", JsonKind::kObject, true));
      ASSIGN_OR_RETURN(std::string id, r.String(*seq, Reader::Path(item_path, "Sequence"), "id"));
      if (id != "A" || seen_sequence) return r.Error(item_path, "must name sequence A once");
      seen_sequence = true;
      continue;
    }
    ASSIGN_OR_RETURN(const json* special, r.Get(item, item_path, "SpecialToken", JsonKind::kObject, true));
    ASSIGN_OR_RETURN(std::string name, r.String(*special, Reader::Path(item_path, "SpecialToken"), "id"));
    const std::string specials_path = Reader::Path(path, "special_tokens");
    if (specials == nullptr || !specials->contains(name)) {
      return r.Error(item_path, "names a token missing from special_tokens");
    }
    const std::string entry_path = Reader::Path(specials_path, name);
    const json& entry = (*specials)[name];
    if (!entry.is_object()) return r.Error(entry_path, "must be an object");
    ASSIGN_OR_RETURN(const json* ids, r.Get(entry, entry_path, "ids", JsonKind::kArray, true));
    for (size_t k = 0; k < ids->size(); ++k) {
      ASSIGN_OR_RETURN(int32_t id, r.TokenIdValue((*ids)[k], Reader::Index(Reader::Path(entry_path, "ids"), k)));
      (seen_sequence ? suffix : prefix)->push_back(id);
    }
  }
  if (!seen_sequence) return r.Error(single_path, "must contain {\"Sequence\": {\"id\": \"A\"}}");
  return absl::OkStatus();
}

}  // namespace

absl::Status Tokenizer::Impl::ParseModel(const Reader& r, const json& doc) {
  ASSIGN_OR_RETURN(const json* model, r.Get(doc, "", "model", JsonKind::kObject, true));
  ASSIGN_OR_RETURN(std::string model_type, r.Type(*model, "model"));
  if (model_type != "BPE") return r.Unsupported("model", model_type, "BPE");
  if (auto it = model->find("dropout"); it != model->end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0) {
      return r.Error("model.dropout", "must be null (quantd encodes deterministically)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    ASSIGN_OR_RETURN(const json* v, r.Get(*model, "model", key, JsonKind::kString, false));
    if (v != nullptr && !v->get<std::string>().empty()) {
      return r.Error(Reader::Path("model", key), "must be null (unsupported by quantd)");
    }
  }
  ASSIGN_OR_RETURN(bool ignore_merges, r.Bool(*model, "model", "ignore_merges", false));
  ASSIGN_OR_RETURN(const json* vocab, r.Get(*model, "model", "vocab", JsonKind::kObject, true));
  if (vocab->size() > kMaxVocabEntries) return r.TooMany("model.vocab", vocab->size(), kMaxVocabEntries);
  absl::flat_hash_map<std::string, int32_t> model_ids;  // spelling -> id, for the merges
  model_ids.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    ASSIGN_OR_RETURN(int32_t id, r.TokenIdValue(it.value(), "model.vocab"));
    model_ids.insert_or_assign(it.key(), id);
    SetToken(id, it.key());
  }
  std::array<int32_t, 256> byte_ids;
  for (int b = 0; b < 256; ++b) {
    std::string spelling;
    AppendUtf8(ByteLevelChar(static_cast<uint8_t>(b)), &spelling);
    auto it = model_ids.find(spelling);
    if (it == model_ids.end()) {
      return r.Error("model.vocab", absl::StrFormat("lacks the token of byte 0x%02X", b));
    }
    byte_ids[b] = it->second;
  }
  bpe = std::make_unique<BpeModel>(byte_ids, ignore_merges);
  if (ignore_merges) {
    for (const auto& [spelling, id] : model_ids) {
      if (std::optional<std::string> bytes = ByteLevelToBytes(spelling)) bpe->AddWord(*bytes, id);
    }
  }
  ASSIGN_OR_RETURN(const json* merges, r.Get(*model, "model", "merges", JsonKind::kArray, true));
  if (merges->size() > kMaxMerges) return r.TooMany("model.merges", merges->size(), kMaxMerges);
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string field = Reader::Index("model.merges", i);
    std::string left, right;
    if (m.is_string()) {
      const std::string& line = m.get_ref<const std::string&>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return r.Error(field, "must be two tokens separated by one space");
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return r.Error(field, "must be \"left right\" or [\"left\", \"right\"]");
    }
    auto l = model_ids.find(left);
    auto rt = model_ids.find(right);
    if (l == model_ids.end() || rt == model_ids.end()) {
      return r.Error(field, "names a token that is not in model.vocab");
    }
    auto merged = model_ids.find(left + right);
    if (merged == model_ids.end()) return r.Error(field, "makes a token that is not in model.vocab");
    bpe->AddMerge(l->second, rt->second, merged->second, static_cast<int32_t>(i));
  }
  token_ids = std::move(model_ids);
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParseAddedTokens(const Reader& r, const json& doc) {
  ASSIGN_OR_RETURN(const json* added, r.Get(doc, "", "added_tokens", JsonKind::kArray, false));
  if (added != nullptr && added->size() > kMaxAddedTokens) {
    return r.TooMany("added_tokens", added->size(), kMaxAddedTokens);
  }
  size_t added_bytes = 0;
  for (size_t i = 0; added != nullptr && i < added->size(); ++i) {
    const json& t = (*added)[i];
    const std::string path = Reader::Index("added_tokens", i);
    if (!t.is_object()) return r.Error(path, "must be an object");
    ASSIGN_OR_RETURN(const json* id_json, r.Get(t, path, "id", JsonKind::kInteger, true));
    ASSIGN_OR_RETURN(int32_t id, r.TokenIdValue(*id_json, Reader::Path(path, "id")));
    ASSIGN_OR_RETURN(std::string content, r.String(t, path, "content"));
    if (content.empty()) return r.Error(Reader::Path(path, "content"), "must not be empty");
    added_bytes += content.size();
    if (added_bytes > kMaxAddedTokenBytes) {
      return r.Error("added_tokens", absl::StrCat("holds more than ", kMaxAddedTokenBytes,
                                                  " bytes of content in all"));
    }
    for (const char* option : {"single_word", "lstrip", "rstrip"}) {
      ASSIGN_OR_RETURN(bool set, r.Bool(t, path, option, false));
      if (set) return r.Error(Reader::Path(path, option), "must be false (unsupported by quantd)");
    }
    ASSIGN_OR_RETURN(bool special, r.Bool(t, path, "special", false));
    ASSIGN_OR_RETURN(bool normalized, r.Bool(t, path, "normalized", !special));
    (normalized ? normalized_added : raw_added).Add(content, id);
    token_ids.insert_or_assign(content, id);
    SetToken(id, content);
  }
  return absl::OkStatus();
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view tokenizer_json,
                                                               const std::string& origin,
                                                               std::optional<std::string> bos_token) {
  JsonShape shape;
  json::sax_parse(tokenizer_json.begin(), tokenizer_json.end(), &shape, json::input_format_t::json,
                  /*strict=*/true);
  if (shape.too_many) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": has more than ", kMaxJsonValues, " JSON values"));
  }
  if (shape.too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": nests JSON deeper than ", kMaxJsonDepth, " levels"));
  }
  if (shape.invalid) return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON"));
  const json doc = json::parse(tokenizer_json.begin(), tokenizer_json.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON"));
  if (!doc.is_object()) return absl::InvalidArgumentError(absl::StrCat(origin, ": must be a JSON object"));
  const Reader r(origin);
  auto impl = std::make_unique<Impl>();
  impl->origin = origin;

  RETURN_IF_ERROR(impl->ParseModel(r, doc));
  RETURN_IF_ERROR(impl->ParseAddedTokens(r, doc));

  // Normalizer, pre-tokenizer, post-processor, decoder.
  if (auto it = doc.find("normalizer"); it != doc.end() && !it->is_null()) {
    RETURN_IF_ERROR(ParseNormalizer(r, *it, "normalizer", &impl->normalizer));
    if (impl->normalizer.size() > kMaxSteps) {
      return r.Error("normalizer", absl::StrCat("has ", impl->normalizer.size(),
                                                " steps; quantd reads at most ", kMaxSteps));
    }
  }
  ASSIGN_OR_RETURN(const json* pre, r.Get(doc, "", "pre_tokenizer", JsonKind::kObject, true));
  int byte_level = 0;
  RETURN_IF_ERROR(ParsePreTokenizer(r, *pre, "pre_tokenizer", &impl->pre_tokenizer, &byte_level));
  if (byte_level == 0) {
    return r.Error("pre_tokenizer", "must end with a ByteLevel pre-tokenizer (byte-level BPE)");
  }
  if (impl->pre_tokenizer.size() > kMaxSteps) {
    return r.Error("pre_tokenizer", absl::StrCat("has ", impl->pre_tokenizer.size(),
                                                 " steps; quantd reads at most ", kMaxSteps));
  }
  if (auto it = doc.find("post_processor"); it != doc.end() && !it->is_null()) {
    RETURN_IF_ERROR(ParsePostProcessor(r, *it, "post_processor", &impl->post_prefix, &impl->post_suffix));
  }
  ASSIGN_OR_RETURN(const json* decoder, r.Get(doc, "", "decoder", JsonKind::kObject, false));
  if (decoder != nullptr) {
    ASSIGN_OR_RETURN(std::string decoder_type, r.Type(*decoder, "decoder"));
    impl->byte_level_decoder = decoder_type == "ByteLevel";
  }
  for (const auto* ids : {&impl->post_prefix, &impl->post_suffix}) {
    for (int32_t id : *ids) {
      if (static_cast<size_t>(id) >= impl->has_token.size() || !impl->has_token[id]) {
        return r.Error("post_processor", "adds an id that has no token");
      }
    }
  }
  if (bos_token.has_value()) {
    auto it = impl->token_ids.find(*bos_token);
    if (it == impl->token_ids.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": the configured bos_token is not a token of this tokenizer"));
    }
    impl->bos = it->second;
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

// The largest tokenizer.json read (DeepSeek's is 7.8 MB; its values are counted before parsing).
constexpr uint64_t kMaxTokenizerFileBytes = 64ull << 20;
// The largest tokenizer_config.json read, parsed whole for its bos_token (DeepSeek's is 3 KB;
// with a chat template, tens of KB).
constexpr uint64_t kMaxTokenizerConfigBytes = 4ull << 20;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::LoadDir(const std::string& dir,
                                                              const checkpoint::SourceRoots& roots) {
  const std::string json_path = (std::filesystem::path(dir) / "tokenizer.json").string();
  ASSIGN_OR_RETURN(std::string text,
                   checkpoint::ReadFile(json_path, kMaxTokenizerFileBytes, roots));
  std::optional<std::string> bos_token;
  const std::string config_path = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) {
    ASSIGN_OR_RETURN(std::string config_text,
                     checkpoint::ReadFile(config_path, kMaxTokenizerConfigBytes, roots));
    const json config = json::parse(config_text, nullptr, /*allow_exceptions=*/false);
    if (!config.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": not a JSON object"));
    }
    auto it = config.find("bos_token");
    if (it != config.end() && it->is_string()) {
      bos_token = it->get<std::string>();
    } else if (it != config.end() && it->is_object() && it->contains("content") &&
               (*it)["content"].is_string()) {
      bos_token = (*it)["content"].get<std::string>();
    } else if (it != config.end() && !it->is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(
          config_path, ": field 'bos_token' must be a string or an object with a 'content' string"));
    }
  }
  return FromJson(text, json_path, std::move(bos_token));
}

absl::StatusOr<std::string> Tokenizer::Impl::Normalize(absl::string_view piece) const {
  const size_t limit = kMaxNormalizeGrowth * piece.size() + kNormalizeSlackBytes;
  const auto too_long = [&](const NormalizeStep& step) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ": field '", step.field, "' makes a text of ", piece.size(),
        " bytes longer than ", limit, " bytes (the normalizer may grow a text ",
        kMaxNormalizeGrowth, " times)"));
  };
  std::string s(piece);
  for (const NormalizeStep& step : normalizer) {
    if (step.kind == NormalizeStep::Kind::kPrepend) {
      if (s.empty()) continue;
      if (s.size() + step.text.size() > limit) return too_long(step);
      s.insert(0, step.text);
      continue;
    }
    std::string replaced;
    size_t pos = 0;
    for (size_t hit; (hit = s.find(step.text, pos)) != std::string::npos; pos = hit + step.text.size()) {
      if (replaced.size() + (hit - pos) + step.replacement.size() > limit) return too_long(step);
      replaced.append(s, pos, hit - pos);
      replaced.append(step.replacement);
    }
    if (replaced.size() + (s.size() - pos) > limit) return too_long(step);
    replaced.append(s, pos);
    s = std::move(replaced);
  }
  return s;
}

absl::Status Tokenizer::Impl::EncodeRaw(absl::string_view text, Encoding& e,
                                        std::vector<int32_t>* out) const {
  size_t pos = 0;
  AddedTokenMatcher::Match m;
  while (raw_added.Find(text, pos, &m)) {
    RETURN_IF_ERROR(EncodeNormalizable(text.substr(pos, m.begin - pos), e, out));
    out->push_back(m.id);
    pos = m.end;
  }
  return EncodeNormalizable(text.substr(pos), e, out);
}

absl::Status Tokenizer::Impl::EncodeNormalizable(absl::string_view piece, Encoding& e,
                                                 std::vector<int32_t>* out) const {
  if (piece.empty()) return absl::OkStatus();
  std::string normalized;
  if (!normalizer.empty()) {
    ASSIGN_OR_RETURN(normalized, Normalize(piece));
    piece = normalized;
  }
  size_t pos = 0;
  AddedTokenMatcher::Match m;
  while (normalized_added.Find(piece, pos, &m)) {
    RETURN_IF_ERROR(PreTokenize(piece.substr(pos, m.begin - pos), 0, e, out));
    out->push_back(m.id);
    pos = m.end;
  }
  return PreTokenize(piece.substr(pos), 0, e, out);
}

absl::Status Tokenizer::Impl::PreTokenize(absl::string_view piece, size_t step, Encoding& e,
                                          std::vector<int32_t>* out) const {
  if (piece.empty()) return absl::OkStatus();
  if (step == pre_tokenizer.size()) {
    bpe->Encode(piece, out);
    return absl::OkStatus();
  }
  const PreTokenizeStep& s = pre_tokenizer[step];
  if (s.kind == PreTokenizeStep::Kind::kPrefixSpace) {
    if (piece[0] == ' ') return PreTokenize(piece, step + 1, e, out);
    const std::string spaced = absl::StrCat(" ", piece);
    return PreTokenize(spaced, step + 1, e, out);
  }
  // The pieces of `piece`: matches and the text between them, in order.
  struct Span {
    size_t begin, end;
    bool match;
  };
  absl::InlinedVector<Span, 16> spans;
  size_t pos = 0, begin = 0, end = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool found, s.regex->Find(piece, pos, e.budget, e.scratch, &begin, &end));
    if (!found) break;
    if (begin > pos) spans.push_back({pos, begin, s.invert});
    spans.push_back({begin, end, !s.invert});
    pos = end;
  }
  if (pos < piece.size()) spans.push_back({pos, piece.size(), s.invert});

  // Apply the behaviour (the `tokenizers` SplitDelimiterBehavior rules).
  absl::InlinedVector<Span, 16> kept;
  switch (s.behavior) {
    case SplitBehavior::kIsolated:
      kept = std::move(spans);
      break;
    case SplitBehavior::kRemoved:
      for (const Span& sp : spans) {
        if (!sp.match) kept.push_back(sp);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.match && !previous_match && !kept.empty()) {
          kept.back().end = sp.end;
        } else {
          kept.push_back(sp);
        }
        previous_match = sp.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !kept.empty()) {
          kept.back().begin = it->begin;
        } else {
          kept.push_back(*it);
        }
        previous_match = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.match == previous_match && !kept.empty()) {
          kept.back().end = sp.end;
        } else {
          kept.push_back(sp);
        }
        previous_match = sp.match;
      }
      break;
    }
  }
  for (const Span& sp : kept) {
    RETURN_IF_ERROR(PreTokenize(piece.substr(sp.begin, sp.end - sp.begin), step + 1, e, out));
  }
  return absl::OkStatus();
}

absl::Duration Tokenizer::EncodeBudget(size_t bytes) {
  return absl::Ceil(kEncodeBaseBudget + kEncodeBudgetPerMib * (static_cast<double>(bytes) / (1 << 20)),
                    absl::Milliseconds(1));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text) const {
  return Encode(text, EncodeBudget(text.size()));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text,
                                                       absl::Duration cpu_budget) const {
  if (std::optional<size_t> bad = FirstInvalidUtf8(text)) {
    return absl::InvalidArgumentError(absl::StrCat("text is not valid UTF-8 (byte ", *bad, ")"));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  Impl::Encoding e{TextBudget(cpu_budget), {}};
  RETURN_IF_ERROR(impl_->EncodeRaw(text, e, &ids));
  return ids;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::EncodeWithSpecialTokens(absl::string_view text) const {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, Encode(text));
  ids.insert(ids.begin(), impl_->post_prefix.begin(), impl_->post_prefix.end());
  ids.insert(ids.end(), impl_->post_suffix.begin(), impl_->post_suffix.end());
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids) const {
  if (!impl_->byte_level_decoder) {
    return absl::FailedPreconditionError("the tokenizer's decoder is not ByteLevel");
  }
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!HasToken(ids[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("id ", ids[i], " (position ", i, ") has no token in this tokenizer"));
    }
    bytes.append(impl_->id_bytes[ids[i]]);
  }
  return Utf8Lossy(bytes);
}

bool Tokenizer::HasToken(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->has_token.size() && impl_->has_token[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->has_token.size()); }

std::optional<int32_t> Tokenizer::TokenId(absl::string_view token) const {
  auto it = impl_->token_ids.find(token);
  if (it == impl_->token_ids.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }

}  // namespace quantd::tokenizer
