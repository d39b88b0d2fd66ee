#include "server/tokenize_command.h"

#include <stdint.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/base/utf8.h"
#include "server/tokenizer/chat_encoding.h"
#include "server/tokenizer/tokenizer.h"

namespace quantd {
namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;

using nlohmann::json;

// One input line -> one output line.
absl::StatusOr<std::string> ConvertLine(const tokenizer::Tokenizer& tokenizer,
                                        const TokenizeArgs& args, const std::string& line) {
  if (std::optional<size_t> bad = base::FirstInvalidUtf8(line)) {
    return absl::InvalidArgumentError(absl::StrCat("not valid UTF-8 (byte ", *bad, ")"));
  }
  const json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  if (args.decode) {
    if (!value.is_array()) return absl::InvalidArgumentError("must be a JSON array of token ids");
    std::vector<int32_t> ids;
    for (const json& id : value) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return absl::InvalidArgumentError("must be a JSON array of token ids");
      }
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    ASSIGN_OR_RETURN(std::string text, tokenizer.Decode(ids));
    return json(text).dump();
  }
  std::string text;
  if (args.chat) {
    ASSIGN_OR_RETURN(std::vector<tokenizer::ChatMessage> messages,
                     tokenizer::ParseChatMessages(value));
    text = tokenizer::RenderChat(messages, /*add_bos=*/true);
  } else {
    if (!value.is_string()) return absl::InvalidArgumentError("must be a JSON string");
    text = value.get<std::string>();
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, args.add_special_tokens
                                                 ? tokenizer.EncodeWithSpecialTokens(text)
                                                 : tokenizer.Encode(text));
  return absl::StrCat("[", absl::StrJoin(ids, ","), "]");
}

}  // namespace

int TokenizeMain(const TokenizeArgs& args, std::istream& in, std::ostream& out, std::ostream& err) {
  if (args.decode && (args.chat || args.add_special_tokens)) {
    err << "quantd tokenize: --decode cannot be combined with --chat or --add-special-tokens\n";
    return kUsage;
  }
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tokenizer =
      tokenizer::Tokenizer::LoadDir(args.tokenizer_dir);
  if (!tokenizer.ok()) {
    err << "quantd tokenize: " << tokenizer.status().message() << "\n";
    return kUsage;
  }
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    absl::StatusOr<std::string> converted = ConvertLine(**tokenizer, args, line);
    if (!converted.ok()) {
      out.flush();
      err << "quantd tokenize: stdin line " << number << ": " << converted.status().message() << "\n";
      return kFailure;
    }
    out << *converted << '\n';
  }
  out.flush();
  return 0;
}

void AddTokenizeCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Tokenize JSON strings (or chat messages) from stdin with a checkpoint's tokenizer");
  cmd->add_option("--tokenizer", args->tokenizer_dir, "directory with tokenizer.json")->required();
  cmd->add_flag("--chat", args->chat, "each line is a JSON messages array, rendered as DeepSeek chat");
  cmd->add_flag("--add-special-tokens", args->add_special_tokens,
                "apply the tokenizer's post-processor (e.g. its BOS)");
  cmd->add_flag("--decode", args->decode, "each line is a JSON id array; print the text");
  cmd->callback([args, &rc] {
    std::ios::sync_with_stdio(false);
    rc = TokenizeMain(*args, std::cin, std::cout, std::cerr);
  });
}

}  // namespace quantd
