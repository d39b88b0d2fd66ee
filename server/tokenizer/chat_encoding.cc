#include "server/tokenizer/chat_encoding.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/base/excerpt.h"

namespace quantd::tokenizer {

absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(const nlohmann::json& messages) {
  if (!messages.is_array() || messages.empty()) {
    return absl::InvalidArgumentError("'messages' must be a non-empty array");
  }
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    const std::string path = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " must be an object"));
    ChatMessage message;
    auto role = m.find("role");
    const std::string role_name = role != m.end() && role->is_string() ? role->get<std::string>() : "";
    if (role_name == "system") {
      message.role = ChatMessage::Role::kSystem;
    } else if (role_name == "user") {
      message.role = ChatMessage::Role::kUser;
    } else if (role_name == "assistant") {
      message.role = ChatMessage::Role::kAssistant;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".role must be \"system\", \"user\" or \"assistant\""));
    }
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string& key = it.key();
      std::string* field = nullptr;
      if (key == "role") continue;
      if (key == "content") field = &message.content;
      if (key == "reasoning_content" && message.role == ChatMessage::Role::kAssistant) {
        field = &message.reasoning_content;
      }
      if (field == nullptr) {
        // The key is the data set's text: named as is only when short and plain.
        const bool plain = key.size() <= 64 && std::all_of(key.begin(), key.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_';
        });
        return absl::InvalidArgumentError(absl::StrCat(
            path, plain ? "." : " key ", plain ? key : base::Excerpt(key, 64),
            " is not a rendered field (",
            message.role == ChatMessage::Role::kAssistant ? "role, content and reasoning_content"
                                                          : "role and content",
            ")"));
      }
      if (it->is_null()) continue;
      if (!it->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ".", key, " must be a string"));
      }
      *field = it->get<std::string>();
    }
    out.push_back(std::move(message));
  }
  return out;
}

std::string RenderChat(const std::vector<ChatMessage>& messages, bool add_bos) {
  using Role = ChatMessage::Role;
  bool thinking = false;
  for (const ChatMessage& m : messages) {
    if (m.role == Role::kAssistant && !m.reasoning_content.empty()) thinking = true;
  }
  std::string text = add_bos ? kBosText : "";
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    switch (m.role) {
      case Role::kSystem:
        text += m.content;
        break;
      case Role::kUser: {
        text += kUserText;
        text += m.content;
        while (i + 1 < messages.size() && messages[i + 1].role == Role::kUser) {
          text += "\n\n";
          text += messages[++i].content;
        }
        if (i + 1 == messages.size() || messages[i + 1].role == Role::kAssistant) {
          text += kAssistantText;
          text += thinking ? kThinkStartText : kThinkEndText;
        }
        break;
      }
      case Role::kAssistant:
        if (thinking) absl::StrAppend(&text, m.reasoning_content, kThinkEndText);
        absl::StrAppend(&text, m.content, kEosText);
        break;
    }
  }
  return text;
}

}  // namespace quantd::tokenizer
