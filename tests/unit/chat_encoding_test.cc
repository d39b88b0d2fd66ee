// Chat rendering against the exact strings DeepSeek's encode_messages produces for the same
// conversations (thinking_mode "chat", or "thinking" with drop_thinking=False).
#include "server/tokenizer/chat_encoding.h"

#include <gtest/gtest.h>

#include <string>

namespace quantd::tokenizer {
namespace {

using nlohmann::json;

const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEos = "<｜end▁of▁sentence｜>";

std::string Render(const std::string& messages_json, bool add_bos = true) {
  auto messages = ParseChatMessages(json::parse(messages_json));
  EXPECT_TRUE(messages.ok()) << messages.status();
  return messages.ok() ? RenderChat(*messages, add_bos) : "";
}

std::string ErrorOf(const std::string& messages_json) {
  auto messages = ParseChatMessages(json::parse(messages_json));
  EXPECT_FALSE(messages.ok());
  return std::string(messages.status().message());
}

TEST(ChatEncodingTest, SystemUserAssistant) {
  EXPECT_EQ(Render(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "Hi"}])"),
            kBos + "S<｜User｜>hello<｜Assistant｜></think>Hi" + kEos);
}

TEST(ChatEncodingTest, MultiTurnChat) {
  EXPECT_EQ(Render(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])"),
            kBos + "<｜User｜>a<｜Assistant｜></think>b" + kEos + "<｜User｜>c<｜Assistant｜></think>d" + kEos);
}

TEST(ChatEncodingTest, ReasoningKeptInThinkingMode) {
  // Any reasoning_content switches the conversation to thinking mode; every turn keeps its
  // reasoning, and a turn without any still gets the empty <think></think>.
  EXPECT_EQ(Render(R"([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                       {"role": "user", "content": "q2"},
                       {"role": "assistant", "content": "a2", "reasoning_content": "r2"}])"),
            kBos + "<｜User｜>q1<｜Assistant｜><think></think>a1" + kEos +
                "<｜User｜>q2<｜Assistant｜><think>r2</think>a2" + kEos);
}

TEST(ChatEncodingTest, TrailingUserGetsTheAssistantPrompt) {
  EXPECT_EQ(Render(R"([{"role": "user", "content": "hi"}])"), kBos + "<｜User｜>hi<｜Assistant｜></think>");
}

TEST(ChatEncodingTest, ConsecutiveUsersAreOneTurn) {
  EXPECT_EQ(Render(R"([{"role": "user", "content": "x"}, {"role": "user", "content": "y"},
                       {"role": "assistant", "content": "z"}])"),
            kBos + "<｜User｜>x\n\ny<｜Assistant｜></think>z" + kEos);
}

TEST(ChatEncodingTest, SystemAfterUserGetsNoAssistantPrompt) {
  EXPECT_EQ(Render(R"([{"role": "user", "content": "u"}, {"role": "system", "content": "s"},
                       {"role": "assistant", "content": "a"}])"),
            kBos + "<｜User｜>usa" + kEos);
}

TEST(ChatEncodingTest, WithoutBosAndWithNullContent) {
  EXPECT_EQ(Render(R"([{"role": "user", "content": null}, {"role": "assistant", "content": "a"}])",
                   /*add_bos=*/false),
            "<｜User｜><｜Assistant｜></think>a" + kEos);
}

TEST(ChatEncodingTest, BadMessagesNameTheElement) {
  EXPECT_EQ(ErrorOf("[]"), "'messages' must be a non-empty array");
  EXPECT_EQ(ErrorOf(R"({"role": "user"})"), "'messages' must be a non-empty array");
  EXPECT_EQ(ErrorOf(R"([{"role": "user", "content": "x"}, 3])"), "messages[1] must be an object");
  EXPECT_EQ(ErrorOf(R"([{"role": "tool", "content": "x"}])"),
            "messages[0].role must be \"system\", \"user\" or \"assistant\"");
  EXPECT_EQ(ErrorOf(R"([{"content": "x"}])"), "messages[0].role must be \"system\", \"user\" or \"assistant\"");
  EXPECT_EQ(ErrorOf(R"([{"role": "user", "content": 5}])"), "messages[0].content must be a string");
  EXPECT_EQ(ErrorOf(R"([{"role": "user", "content": "x", "reasoning_content": "r"}])"),
            "messages[0].reasoning_content is not a rendered field (role and content)");
  EXPECT_EQ(ErrorOf(R"([{"role": "assistant", "content": "", "tool_calls": []}])"),
            "messages[0].tool_calls is not a rendered field (role, content and reasoning_content)");
}

}  // namespace
}  // namespace quantd::tokenizer
