// `quantd tokenize --tokenizer DIR [--chat] [--add-special-tokens] [--decode]`: the tokenizer of
// a checkpoint (DIR/tokenizer.json, server/tokenizer/tokenizer.h) as a filter. Each stdin line is a
// JSON string (with --chat, a JSON messages array, rendered by server/tokenizer/chat_encoding.h);
// each stdout line is the JSON array of its ids, the ids the `tokenizers` library gives for
// `encode(text, add_special_tokens=False)`. --add-special-tokens applies the file's
// post-processor. --decode reads JSON id arrays and prints JSON strings.
//
// Exit codes: 0 every line converted, 1 a line failed (the message names the line; the lines
// before it were printed), 2 usage or an unreadable tokenizer.
#ifndef QUANTD_SERVER_TOKENIZE_COMMAND_H_
#define QUANTD_SERVER_TOKENIZE_COMMAND_H_

#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct TokenizeArgs {
  std::string tokenizer_dir;        // --tokenizer
  bool chat = false;                // --chat
  bool add_special_tokens = false;  // --add-special-tokens
  bool decode = false;              // --decode
};

// Converts `in` to `out` line by line; returns the exit code (errors go to `err`).
int TokenizeMain(const TokenizeArgs& args, std::istream& in, std::ostream& out, std::ostream& err);

// Registers the `tokenize` subcommand; its callback stores the exit code in `rc`.
void AddTokenizeCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_TOKENIZE_COMMAND_H_
