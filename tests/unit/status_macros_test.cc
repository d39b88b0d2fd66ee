#include "server/base/status_macros.h"

#include <string>

#include "gtest/gtest.h"

namespace quantd {
namespace {

int evaluations = 0;

absl::Status Fails(absl::StatusCode code) {
  ++evaluations;
  return absl::Status(code, "from Fails");
}

absl::StatusOr<std::string> Value(bool ok) {
  ++evaluations;
  if (!ok) return absl::NotFoundError("no value");
  return std::string("value");
}

absl::Status Chain(bool first_ok, bool second_ok, std::string* out) {
  if (!first_ok) RETURN_IF_ERROR(Fails(absl::StatusCode::kDataLoss));
  ASSIGN_OR_RETURN(std::string v, Value(second_ok));
  ASSIGN_OR_RETURN(*out, Value(true));  // assigns to an existing lvalue
  *out += "+" + v;
  return absl::OkStatus();
}

absl::StatusOr<int> ChainOr(bool ok) {
  RETURN_IF_ERROR(ok ? absl::OkStatus() : Fails(absl::StatusCode::kUnavailable));
  return 7;
}

TEST(StatusMacrosTest, PropagatesTheFirstErrorUnchangedAndEvaluatesOnce) {
  std::string out;
  evaluations = 0;
  absl::Status s = Chain(false, true, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "from Fails");
  EXPECT_EQ(evaluations, 1);

  evaluations = 0;
  s = Chain(true, false, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(evaluations, 1);

  evaluations = 0;
  ASSERT_TRUE(Chain(true, true, &out).ok());
  EXPECT_EQ(out, "value+value");
  EXPECT_EQ(evaluations, 2);
}

TEST(StatusMacrosTest, WorksInFunctionsReturningStatusOr) {
  EXPECT_EQ(ChainOr(true).value(), 7);
  EXPECT_EQ(ChainOr(false).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace quantd
