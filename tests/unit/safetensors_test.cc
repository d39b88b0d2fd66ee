// safetensors reader (hostile headers, one test per rejected case) and streaming writer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/sha256.h"
#include "tests/unit/test_dirs.h"

namespace quantd::checkpoint {
namespace {

namespace fs = std::filesystem;

// A file image: little-endian u64 length of `header`, the header, then `data`.
std::string Image(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t{header.size()} >> (8 * i));
  return out + header + data;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(const std::string& bytes) {
  return SafetensorsFile::FromBytes("hostile.safetensors",
                                    reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// Expects `bytes` to be rejected with a message that contains each of `parts`.
void ExpectRejected(const std::string& bytes, const std::vector<std::string>& parts) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = Parse(bytes);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  std::string message(file.status().message());
  EXPECT_NE(message.find("hostile.safetensors: "), std::string::npos) << message;
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "missing \"" << part << "\" in: " << message;
  }
}

// One F32 [2] tensor "w" at [0, 8) of an 8-byte data section, with `entry` replacing its entry.
std::string OneTensor(const std::string& entry, const std::string& data = std::string(8, 'x')) {
  return Image(R"({"w":)" + entry + "}", data);
}

using testing_util::TempDirTest;
using SafetensorsReaderFile = TempDirTest;
using SafetensorsWriterTest = TempDirTest;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// ---- valid inputs ----

TEST(SafetensorsReader, ParsesTensorsInOffsetOrderWithViewsIntoTheImage) {
  std::string bytes = Image(
      R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},)"
      R"("a":{"dtype":"BF16","shape":[1,2],"data_offsets":[0,4]},)"
      R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[6,6]},)"
      R"("s":{"dtype":"I64","shape":[],"data_offsets":[6,14]},)"
      R"("__metadata__":{"format":"pt"}}  )",
      "ABCDEF01234567");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<TensorView>& t = (*file)->tensors();
  ASSERT_EQ(t.size(), 4u);
  const uint64_t data_start = bytes.size() - 14;
  EXPECT_EQ(t[0].name, "a");
  EXPECT_EQ(t[1].name, "b");
  EXPECT_EQ(t[2].name, "z");
  EXPECT_EQ(t[3].name, "s");
  EXPECT_EQ(t[0].dtype, Dtype::kBF16);
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(t[0].numel(), 2);
  EXPECT_EQ(t[0].offset, data_start);
  EXPECT_EQ(t[0].size, 4u);
  EXPECT_EQ(t[0].data, reinterpret_cast<const uint8_t*>(bytes.data()) + data_start);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(t[1].data), 2), "EF");
  EXPECT_EQ(t[2].numel(), 0);
  EXPECT_EQ(t[2].size, 0u);
  EXPECT_EQ(t[3].shape, std::vector<int64_t>{});
  EXPECT_EQ(t[3].numel(), 1);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(t[3].data), 8), "01234567");
  EXPECT_EQ((*file)->Find("b"), &t[1]);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ((*file)->file_size(), bytes.size());
}

TEST(SafetensorsReader, AcceptsEmptyHeaderObject) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = Parse(Image("{}"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsReader, BracketsInsideStringsDoNotCountAsNesting) {
  std::string deep(40, '[');
  std::string bytes = Image(R"({"__metadata__":{"k":"\")" + deep + R"(", " ":")" + deep + R"("}})");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("k"), "\"" + deep);
  EXPECT_EQ((*file)->metadata().at(" "), deep);
}

TEST_F(SafetensorsReaderFile, OpenMapsFileFromDisk) {
  std::string path = dir_ + "/one.safetensors";
  std::string bytes = OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", "abcdefgh");
  std::ofstream(path, std::ios::binary) << bytes;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  ASSERT_EQ((*file)->tensors().size(), 1u);
  EXPECT_EQ(std::memcmp((*file)->tensors()[0].data, "abcdefgh", 8), 0);
}

// A file read back from a directory handle (a job's own output) is opened beneath it: a
// symbolic link there is refused, never followed to another file.
TEST_F(SafetensorsReaderFile, OpenBeneathAHandleFollowsNoLink) {
  std::filesystem::create_directories(dir_ + "/out");
  std::filesystem::create_directories(dir_ + "/other");
  const std::string bytes =
      OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", "abcdefgh");
  std::ofstream(dir_ + "/out/one.safetensors", std::ios::binary) << bytes;
  std::ofstream(dir_ + "/other/theirs.safetensors", std::ios::binary) << bytes;
  std::filesystem::create_symlink(dir_ + "/other/theirs.safetensors",
                                  dir_ + "/out/link.safetensors");
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", dir_ + "/out");
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(*out, "one.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), dir_ + "/out/one.safetensors");
  ASSERT_EQ((*file)->tensors().size(), 1u);
  EXPECT_EQ(std::memcmp((*file)->tensors()[0].data, "abcdefgh", 8), 0);
  file = SafetensorsFile::Open(*out, "link.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().message(),
            "output: " + dir_ + "/out/link.safetensors: cannot open: it is or passes through a "
            "symbolic link, which quantd does not follow here (was the output directory or a "
            "directory in it replaced by a link?)");
}

TEST_F(SafetensorsReaderFile, OpenNamesMissingFile) {
  std::string path = dir_ + "/absent.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(file.status().message()).find(path), std::string::npos);
}

TEST_F(SafetensorsReaderFile, OpenRejectsEmptyFileAndDirectory) {
  const std::string& dir = dir_;
  std::ofstream(dir + "/empty.safetensors");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(dir + "/empty.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_NE(std::string(file.status().message()).find("file is 0 bytes"), std::string::npos);
  file = SafetensorsFile::Open(dir);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().message(), dir + ": is a directory; only regular files are read");
}

TEST_F(SafetensorsReaderFile, Sha256ReadsTheWholeFileThroughTheMapping) {
  // 65 MiB of data: two chunks of the mapped read, the second partial.
  const std::string path = dir_ + "/big.safetensors";
  const size_t n = (65u << 20) + 3;
  std::vector<uint8_t> bytes(n);
  std::mt19937 rng(7);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  {
    auto writer = SafetensorsWriter::Create(path, {{"w", Dtype::kU8, {static_cast<int64_t>(n)}}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->WriteTensor("w", bytes.data(), n).ok());
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<uint64_t> chunks;
  absl::StatusOr<std::string> mapped = (*file)->Sha256([&](uint64_t c) {
    chunks.push_back(c);
    return absl::OkStatus();
  });
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(*mapped, *Sha256File(path));
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0], uint64_t{64} << 20);
  EXPECT_EQ(chunks[0] + chunks[1], (*file)->file_size());
  // The pages dropped after hashing are read again from the file: the same digest.
  EXPECT_EQ(*(*file)->Sha256(), *mapped);

  // A chunk callback's error stops the read and comes back as it is.
  absl::StatusOr<std::string> stopped =
      (*file)->Sha256([](uint64_t) { return absl::CancelledError("stop"); });
  EXPECT_EQ(stopped.status(), absl::CancelledError("stop"));

  // A file that shrinks under the read: DataLoss naming it, not a SIGBUS.
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  absl::StatusOr<std::string> shrunk = (*file)->Sha256();
  EXPECT_EQ(shrunk.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(std::string(shrunk.status().message()).rfind(path + ": the file shrank below its ", 0),
            0u)
      << shrunk.status();
}

// ---- hostile inputs: one test per rejected case ----

TEST(SafetensorsHostile, FileShorterThanLengthPrefix) {
  ExpectRejected(std::string(7, '\0'), {"file is 7 bytes, too short"});
  ExpectRejected("", {"file is 0 bytes"});
}

TEST(SafetensorsHostile, HeaderLengthPastEndOfFile) {
  std::string bytes = Image("{}");
  bytes[0] = 3;  // claims 3 header bytes, the file holds 2
  ExpectRejected(bytes, {"header length 3 runs past the end of the 10-byte file"});
}

TEST(SafetensorsHostile, HeaderLengthAboveLimit) {
  std::string bytes = Image("{}");
  uint64_t n = SafetensorsFile::kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  ExpectRejected(bytes, {"header length 100000001 exceeds the limit of 100000000"});
  std::string huge(8, '\xff');
  ExpectRejected(huge, {"header length 18446744073709551615 exceeds the limit"});
}

TEST(SafetensorsHostile, HeaderEmpty) { ExpectRejected(Image(""), {"does not start with '{'"}); }

TEST(SafetensorsHostile, HeaderNotStartingWithBrace) {
  ExpectRejected(Image(" {}"), {"does not start with '{'"});
  ExpectRejected(Image("[]"), {"does not start with '{'"});
}

TEST(SafetensorsHostile, HeaderNotJson) {
  ExpectRejected(Image("{abc}"), {"header is not valid JSON"});
  ExpectRejected(Image(R"({"a":1} x)"), {"header is not valid JSON"});
  ExpectRejected(Image(R"({"a":"\xff"})"), {"header is not valid JSON"});
  ExpectRejected(Image("{/*c*/}"), {"header is not valid JSON"});
}

TEST(SafetensorsHostile, HeaderNestedTooDeep) {
  // 1 (outer object) + 16 arrays = 17 levels > kMaxJsonDepth.
  int n = SafetensorsFile::kMaxJsonDepth;
  ExpectRejected(Image(R"({"a":)" + std::string(n, '[') + std::string(n, ']') + "}"),
                 {"nests deeper than 16"});
  // Unterminated nesting is caught by the scan too, long before any parser sees it.
  ExpectRejected(Image("{" + std::string(1 << 20, '[')), {"nests deeper than 16"});
  // 16 levels are fine as far as nesting goes (the entry itself is then rejected).
  ExpectRejected(Image(R"({"a":)" + std::string(n - 1, '[') + std::string(n - 1, ']') + "}"),
                 {"tensor \"a\": entry is not a JSON object"});
}

TEST(SafetensorsHostile, EntryNotObject) {
  ExpectRejected(OneTensor("[1,2]"), {"tensor \"w\": entry is not a JSON object"});
}

TEST(SafetensorsHostile, EntryMissingField) {
  ExpectRejected(OneTensor(R"({"shape":[2],"data_offsets":[0,8]})"),
                 {"tensor \"w\": missing field \"dtype\""});
  ExpectRejected(OneTensor(R"({"dtype":"F32","data_offsets":[0,8]})"),
                 {"tensor \"w\": missing field \"shape\""});
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[2]})"),
                 {"tensor \"w\": missing field \"data_offsets\""});
}

TEST(SafetensorsHostile, EntryExtraField) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})"),
                 {"tensor \"w\": unexpected field \"x\""});
}

TEST(SafetensorsHostile, UnknownDtype) {
  ExpectRejected(OneTensor(R"({"dtype":"F4","shape":[2],"data_offsets":[0,8]})"),
                 {"tensor \"w\": unknown dtype \"F4\""});
  ExpectRejected(OneTensor(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"),
                 {"tensor \"w\": unknown dtype \"f32\""});
  ExpectRejected(OneTensor(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"),
                 {"tensor \"w\": dtype is not a string"});
}

TEST(SafetensorsHostile, ShapeNotNonNegativeIntegers) {
  for (const char* shape : {"2", "[-2]", "[2.0]", "[\"2\"]", "[true]", "[[2]]", "[null]",
                            "[9223372036854775808]", "[1e3]"}) {
    ExpectRejected(
        OneTensor(std::string(R"({"dtype":"F32","shape":)") + shape + R"(,"data_offsets":[0,8]})"),
        {"tensor \"w\": shape"});
  }
}

TEST(SafetensorsHostile, ShapeProductOverflows) {
  ExpectRejected(
      OneTensor(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
      {"tensor \"w\": shape [4294967296,4294967296] overflows 64 bits"});
  // numel fits int64 but numel * 8 bytes does not.
  ExpectRejected(
      OneTensor(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})"),
      {"overflows 64 bits"});
  // An overflowing partial product is rejected even when a later 0 would zero the product.
  ExpectRejected(
      OneTensor(R"({"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,8]})"),
      {"overflows 64 bits"});
}

TEST(SafetensorsHostile, DataOffsetsNotPairOfNonNegativeIntegers) {
  for (const char* offsets : {"[0]", "[0,8,8]", "[-1,8]", "[0,8.0]", "{\"0\":8}", "[0,\"8\"]",
                              "[0,18446744073709551616]"}) {
    ExpectRejected(OneTensor(std::string(R"({"dtype":"F32","shape":[2],"data_offsets":)") +
                             offsets + "}"),
                   {"tensor \"w\": data_offsets", "is not a pair of non-negative integers"});
  }
}

TEST(SafetensorsHostile, DataOffsetsEndBeforeBegin) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"),
                 {"tensor \"w\": data_offsets [8, 0] end before they begin"});
}

TEST(SafetensorsHostile, OffsetsOverlap) {
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                       std::string(8, 'x')),
                 {"tensor \"b\": data_offsets [4, 8] overlap tensor \"a\""});
  // Two tensors claiming the same bytes.
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                       std::string(16, 'x')),
                 {"tensor \"b\": data_offsets [0, 8] overlap tensor \"a\""});
}

TEST(SafetensorsHostile, OffsetsLeaveGap) {
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})",
                       std::string(10, 'x')),
                 {"tensor \"b\": data_offsets [6, 10] leave a gap: no tensor holds bytes [4, 6)"});
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"),
                 {"tensor \"w\"", "no tensor holds bytes [0, 4)"});
}

TEST(SafetensorsHostile, OffsetsDoNotCoverDataSection) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})",
                           std::string(9, 'x')),
                 {"tensors cover 8 bytes but the data section holds 9"});
  ExpectRejected(Image("{}", "x"), {"tensors cover 0 bytes but the data section holds 1"});
}

TEST(SafetensorsHostile, OffsetsPastEndOfFile) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})",
                           std::string(7, 'x')),
                 {"tensor \"w\": data_offsets [0, 8] run past the end of the file (data "
                  "section is 7 bytes)"});
  ExpectRejected(
      OneTensor(R"({"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]})"),
      {"tensor \"w\"", "run past the end of the file"});
}

TEST(SafetensorsHostile, SizeDoesNotMatchShape) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                 {"tensor \"w\": F32 shape [3] needs 12 bytes but data_offsets [0, 8] hold 8"});
  ExpectRejected(OneTensor(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,8]})"),
                 {"tensor \"w\": BF16 shape [2] needs 4 bytes"});
}

TEST(SafetensorsHostile, DuplicateTensorName) {
  ExpectRejected(Image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                       "xy"),
                 {"duplicate tensor name \"a\""});
}

TEST(SafetensorsHostile, DuplicateFieldInsideEntry) {
  ExpectRejected(OneTensor(R"({"dtype":"F32","dtype":"U8","shape":[2],"data_offsets":[0,8]})"),
                 {"duplicate key \"dtype\""});
  ExpectRejected(Image(R"({"__metadata__":{"k":"1","k":"2"}})"), {"duplicate key \"k\""});
}

TEST(SafetensorsHostile, MetadataNotStringMap) {
  ExpectRejected(Image(R"({"__metadata__":[1]})"), {"__metadata__ is not a JSON object"});
  ExpectRejected(Image(R"({"__metadata__":"x"})"), {"__metadata__ is not a JSON object"});
  ExpectRejected(Image(R"({"__metadata__":{"k":1}})"),
                 {"__metadata__ value for \"k\" is not a string"});
  ExpectRejected(Image(R"({"__metadata__":{"k":{"a":"b"}}})"),
                 {"__metadata__ value for \"k\" is not a string"});
}

TEST(SafetensorsHostile, HostileNameIsEscapedAndShortened) {
  ExpectRejected(Image(R"({"\u0001)" + std::string(300, 'n') +
                           R"(":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})",
                       std::string(8, 'x')),
                 {"tensor \"\\x01nnn", "nnn...\": unexpected field \"x\""});
}

// ---- writer ----

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST_F(SafetensorsWriterTest, RoundTripsEveryDtype) {
  std::string path = dir_ + "/all.safetensors";
  std::vector<TensorSpec> specs;
  std::vector<std::string> contents;
  for (Dtype d : kAllDtypes) {
    specs.push_back({"t." + std::string(DtypeName(d)), d, {3, 5}});
    contents.push_back(RandomBytes(specs.back().bytes(), static_cast<uint32_t>(d)));
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"quantd", "\"q\"\n"}};
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, specs, metadata);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ((*writer)->NextTensor(), specs[i].name);
    ASSERT_TRUE((*writer)->WriteTensor(specs[i].name, contents[i].data(), contents[i].size()).ok());
  }
  EXPECT_EQ((*writer)->NextTensor(), "");
  uint64_t expected_size = (*writer)->total_bytes();
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  std::string bytes = Slurp(path);
  ASSERT_EQ(bytes.size(), expected_size);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(), metadata);
  ASSERT_EQ((*file)->tensors().size(), specs.size());
  uint64_t offset = 8 + header_len;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorView& t = (*file)->tensors()[i];  // file order = declaration order
    EXPECT_EQ(t.name, specs[i].name);
    EXPECT_EQ(t.dtype, specs[i].dtype);
    EXPECT_EQ(t.shape, specs[i].shape);
    EXPECT_EQ(t.size, 15 * DtypeSize(specs[i].dtype));
    EXPECT_EQ(t.offset, offset);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(t.data), t.size), contents[i]);
    offset += t.size;
  }
}

TEST_F(SafetensorsWriterTest, WritesExactlyTheBytesTheFormatRequires) {
  std::string path = dir_ + "/exact.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer = SafetensorsWriter::Create(
      path, {{"a", Dtype::kF32, {2}}, {"b", Dtype::kU8, {3}}}, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const float a[2] = {1.0f, -2.0f};  // 0x3f800000, 0xc0000000
  const uint8_t b[3] = {1, 2, 3};
  ASSERT_TRUE((*writer)->WriteTensor("a", a, sizeof(a)).ok());
  ASSERT_TRUE((*writer)->WriteTensor("b", b, sizeof(b)).ok());
  ASSERT_TRUE((*writer)->Finish().ok());

  // 138 bytes of JSON padded with 6 spaces to 144 = 0x90.
  std::string expected = std::string("\x90\0\0\0\0\0\0\0", 8) +
                         R"({"__metadata__":{"format":"pt"},)"
                         R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})"
                         "      " +
                         std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0\x01\x02\x03", 11);
  EXPECT_EQ(Slurp(path), expected);
}

TEST_F(SafetensorsWriterTest, EmptyMetadataIsOmittedAndEmptyFileIsValid) {
  std::string path = dir_ + "/empty.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer = SafetensorsWriter::Create(path, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->total_bytes(), 16u);
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(Slurp(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

TEST_F(SafetensorsWriterTest, ChunkedAppendsAcrossBufferSizes) {
  std::string path = dir_ + "/chunked.safetensors";
  // "big" exceeds the writer's 8 MiB buffer so both the buffered and the direct path run.
  std::vector<TensorSpec> specs = {{"small", Dtype::kBF16, {1000}},
                                   {"empty", Dtype::kF32, {0, 4}},
                                   {"big", Dtype::kU8, {20 << 20}},
                                   {"tail", Dtype::kI32, {3}}};
  std::vector<std::string> contents;
  for (size_t i = 0; i < specs.size(); ++i) {
    contents.push_back(RandomBytes(specs[i].bytes(), 100 + i));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  // small in 7-byte chunks; the zero-byte tensor is skipped at once.
  for (size_t pos = 0; pos < contents[0].size(); pos += 7) {
    size_t n = std::min<size_t>(7, contents[0].size() - pos);
    ASSERT_TRUE((*writer)->Append(contents[0].data() + pos, n).ok());
  }
  EXPECT_EQ((*writer)->NextTensor(), "big");
  ASSERT_TRUE((*writer)->WriteTensor("empty", nullptr, 0).ok());
  const std::string& big = contents[2];
  ASSERT_TRUE((*writer)->Append(big.data(), 3 << 20).ok());
  ASSERT_TRUE((*writer)->Append(big.data() + (3 << 20), big.size() - (3 << 20) - 5).ok());
  ASSERT_TRUE((*writer)->Append(big.data() + big.size() - 5, 5).ok());
  ASSERT_TRUE((*writer)->Append(contents[3].data(), contents[3].size()).ok());
  ASSERT_TRUE((*writer)->Finish().ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorView* t = (*file)->Find(specs[i].name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(t->data), t->size), contents[i])
        << specs[i].name;
  }
}

TEST_F(SafetensorsWriterTest, AppendPastTensorEndIsRefusedWhole) {
  std::string path = dir_ + "/past.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", Dtype::kF32, {2}}, {"b", Dtype::kU8, {2}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string bytes(12, 'x');
  ASSERT_TRUE((*writer)->Append(bytes.data(), 5).ok());
  absl::Status status = (*writer)->Append(bytes.data(), 4);  // 5 + 4 > 8
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(std::string(status.message())
                .find("tensor \"a\": appending 4 bytes after 5 would exceed its 8 bytes"),
            std::string::npos)
      << status;
  // Nothing was written: the writer goes on from byte 5.
  ASSERT_TRUE((*writer)->Append(bytes.data(), 3).ok());
  ASSERT_TRUE((*writer)->Append(bytes.data(), 2).ok());
  status = (*writer)->Append(bytes.data(), 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(std::string(status.message()).find("1 bytes appended after the last tensor"),
            std::string::npos)
      << status;
  EXPECT_TRUE((*writer)->Finish().ok());
  status = (*writer)->Append(bytes.data(), 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(status.message()), path + ": writer already finished");
}

TEST_F(SafetensorsWriterTest, WriteTensorChecksOrderAndSize) {
  std::string path = dir_ + "/order.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", Dtype::kU8, {2}}, {"b", Dtype::kU8, {2}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->WriteTensor("b", "xy", 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*writer)->WriteTensor("a", "xyz", 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*writer)->WriteTensor("c", "xy", 2).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*writer)->WriteTensor("a", "xy", 2).ok());
  EXPECT_EQ((*writer)->NextTensor(), "b");
  ASSERT_TRUE((*writer)->Append("x", 1).ok());
  absl::Status status = (*writer)->WriteTensor("b", "xy", 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(status.message()).find("tensor \"b\" already has 1 bytes appended"),
            std::string::npos)
      << status;
}

TEST_F(SafetensorsWriterTest, FinishWithMissingBytesLeavesNoFile) {
  std::string path = dir_ + "/short.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", Dtype::kF32, {2}}, {"b", Dtype::kU8, {2}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_TRUE(fs::exists(path + ".tmp"));
  ASSERT_TRUE((*writer)->Append("12345678", 8).ok());
  ASSERT_TRUE((*writer)->Append("1", 1).ok());
  absl::Status status = (*writer)->Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(status.message()).find("tensor \"b\" incomplete: 1 of 2 bytes written"),
            std::string::npos)
      << status;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  status = (*writer)->Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(status.message()), path + ": writer failed earlier");
}

TEST_F(SafetensorsWriterTest, DestroyedWithoutFinishRemovesTmp) {
  std::string path = dir_ + "/dropped.safetensors";
  {
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
        SafetensorsWriter::Create(path, {{"a", Dtype::kU8, {2}}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append("xy", 2).ok());
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SafetensorsWriterTest, FinishReplacesExistingFile) {
  std::string path = dir_ + "/replace.safetensors";
  std::ofstream(path) << "old";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", Dtype::kU8, {1}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ(Slurp(path), "old");  // untouched until Finish()
  ASSERT_TRUE((*writer)->Append("z", 1).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(Slurp(path).back(), 'z');
}

TEST_F(SafetensorsWriterTest, CreateRejectsBadDeclarations) {
  const std::string& dir = dir_;
  auto create_error = [&](std::vector<TensorSpec> specs,
                          std::map<std::string, std::string> metadata = {}) {
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
        SafetensorsWriter::Create(dir + "/bad.safetensors", std::move(specs), std::move(metadata));
    EXPECT_FALSE(writer.ok());
    EXPECT_FALSE(fs::exists(dir + "/bad.safetensors.tmp"));
    return writer.ok() ? std::string() : std::string(writer.status().message());
  };
  EXPECT_NE(create_error({{"a", Dtype::kU8, {1}}, {"a", Dtype::kU8, {1}}})
                .find("tensor \"a\" declared twice"),
            std::string::npos);
  EXPECT_NE(create_error({{"__metadata__", Dtype::kU8, {1}}}).find("is reserved"),
            std::string::npos);
  EXPECT_NE(create_error({{"", Dtype::kU8, {1}}}).find("empty tensor name"), std::string::npos);
  EXPECT_NE(create_error({{"a", Dtype::kU8, {2, -1}}}).find("negative dimension -1"),
            std::string::npos);
  EXPECT_NE(create_error({{"a", Dtype::kF32, {int64_t{1} << 62}}}).find("overflows 64 bits"),
            std::string::npos);
  EXPECT_NE(create_error({{"a\xff", Dtype::kU8, {1}}}).find("not valid UTF-8"), std::string::npos);
  EXPECT_NE(create_error({}, {{"k", "\xc3"}}).find("__metadata__ entry for \"k\""),
            std::string::npos);
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(dir + "/no/such/dir/x.safetensors", {});
  ASSERT_FALSE(writer.ok());
  EXPECT_NE(std::string(writer.status().message()).find(dir + "/no/such/dir/x.safetensors.tmp"),
            std::string::npos);
}

// Throughput of a 1 GiB shard written in 4 KiB (buffered) and 64 MiB (direct) chunks, fsync and
// rename included. Run by hand:
//   safetensors_test --gtest_also_run_disabled_tests --gtest_filter='*Throughput*'
TEST_F(SafetensorsWriterTest, DISABLED_ThroughputOneGiB) {
  std::string path = dir_ + "/big.safetensors";
  const uint64_t total = uint64_t{1} << 30;
  std::string data = RandomBytes(uint64_t{64} << 20, 1);
  for (uint64_t chunk : {uint64_t{4} << 10, uint64_t{64} << 20}) {
    auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
        SafetensorsWriter::Create(path, {{"w", Dtype::kU8, {static_cast<int64_t>(total)}}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (uint64_t done = 0; done < total; done += chunk) {
      ASSERT_TRUE((*writer)->Append(data.data() + done % data.size(), chunk).ok());
    }
    ASSERT_TRUE((*writer)->Finish().ok());
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    printf("wrote 1 GiB in %llu-byte chunks in %.3f s: %.0f MB/s\n",
           static_cast<unsigned long long>(chunk), seconds, total / seconds / 1e6);
    fs::remove(path);
  }
}

TEST_F(SafetensorsWriterTest, HashesTheBytesItWrites) {
  const std::string path = dir_ + "/hashed.safetensors";
  auto writer = SafetensorsWriter::Create(path, {{"a", Dtype::kU8, {3}}, {"b", Dtype::kF32, {1 << 22}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->sha256(), "");
  ASSERT_TRUE((*writer)->Append("xyz", 3).ok());
  std::vector<float> big(1 << 22, 1.5f);  // larger than the writer's buffer: written directly
  ASSERT_TRUE((*writer)->Append(big.data(), big.size() * 4).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  auto on_disk = Sha256File(path);
  ASSERT_TRUE(on_disk.ok());
  EXPECT_EQ((*writer)->sha256(), *on_disk);
}

}  // namespace
}  // namespace quantd::checkpoint
