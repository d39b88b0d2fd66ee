// Chat rendering: a conversation as the text DeepSeek-V3.2/V4 models are trained on, following
// DeepSeek's own `encode_messages` (the `encoding` folder of the DeepSeek-V3.2 and V4 releases;
// a Python function, not a Jinja template) for conversations of system, user and assistant turns:
//
//   - The text starts with <｜begin▁of▁sentence｜> once (unless add_bos is false).
//   - Consecutive user messages are one turn, their texts joined by "\n\n" (V4 merges them).
//   - A system message is its content as is.
//   - A user turn is <｜User｜> + content; when an assistant message follows it, or it is the last
//     message, it is followed by <｜Assistant｜> and then <think> in thinking mode or </think>
//     otherwise.
//   - An assistant message is [reasoning_content + </think>, in thinking mode] + content +
//     <｜end▁of▁sentence｜>.
//   - Thinking mode: a conversation where some assistant message has a non-empty
//     reasoning_content is rendered with thinking_mode="thinking" and drop_thinking=False (the
//     reasoning of every turn is kept, as calibration text); any other conversation with
//     thinking_mode="chat". The reasoning-effort preamble is never added.
//
// E.g. system "S", user "hello", assistant "Hi" renders as
//   <｜begin▁of▁sentence｜>S<｜User｜>hello<｜Assistant｜></think>Hi<｜end▁of▁sentence｜>
#ifndef QUANTD_SERVER_TOKENIZER_CHAT_ENCODING_H_
#define QUANTD_SERVER_TOKENIZER_CHAT_ENCODING_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include <nlohmann/json.hpp>

namespace quantd::tokenizer {

inline constexpr char kBosText[] = "<｜begin▁of▁sentence｜>";
inline constexpr char kEosText[] = "<｜end▁of▁sentence｜>";
inline constexpr char kUserText[] = "<｜User｜>";
inline constexpr char kAssistantText[] = "<｜Assistant｜>";
inline constexpr char kThinkStartText[] = "<think>";
inline constexpr char kThinkEndText[] = "</think>";

struct ChatMessage {
  enum class Role { kSystem, kUser, kAssistant };
  Role role = Role::kUser;
  std::string content;
  std::string reasoning_content;  // assistant messages only
};

// Reads a JSON array of {"role": "system"|"user"|"assistant", "content": string|null,
// "reasoning_content": string|null (assistant only)}. Other keys (tool calls, names) are errors,
// since rendering would drop them; errors name the element, e.g. "messages[2].role".
absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(const nlohmann::json& messages);

// The conversation as text, by the rules above.
std::string RenderChat(const std::vector<ChatMessage>& messages, bool add_bos);

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_CHAT_ENCODING_H_
