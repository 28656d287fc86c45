// ShmObject (transport/shm_object.h): create, open by name / path / fd, map, unlink, and the
// errno -> Status codes a caller acts on.
#include "transport/shm_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::string UniqueName(const char* tag) {
  static int counter = 0;
  return absl::StrCat("/moed-shm-object-test-", tag, "-", getpid(), "-", counter++);
}

bool NameExists(const std::string& name) {
  struct stat st;
  return stat(absl::StrCat("/dev/shm", name).c_str(), &st) == 0;
}

TEST(ShmObjectTest, NamedObjectIsSharedAndUnlinked) {
  const std::string name = UniqueName("named");
  absl::StatusOr<ShmObject> created = ShmObject::CreateNamed(name, 8192);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->size(), 8192u);
  EXPECT_TRUE(NameExists(name));

  absl::StatusOr<ShmObject> opened = ShmObject::OpenNamed(name);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->size(), 8192u);
  absl::StatusOr<ShmMapping> a = created->Map();
  absl::StatusOr<ShmMapping> b = opened->Map();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(b->data()[100], 0);  // zero-filled
  std::strcpy(a->data() + 100, "hello");
  EXPECT_STREQ(b->data() + 100, "hello");

  ASSERT_TRUE(created->Unlink().ok());
  EXPECT_FALSE(NameExists(name));
  EXPECT_TRUE(created->Unlink().ok());  // the second time: nothing to do
  EXPECT_EQ(ShmObject::OpenNamed(name).status().code(), absl::StatusCode::kNotFound);
  EXPECT_STREQ(b->data() + 100, "hello");  // mappings outlive the name
}

TEST(ShmObjectTest, DestructorUnlinksTheName) {
  const std::string name = UniqueName("raii");
  {
    absl::StatusOr<ShmObject> created = ShmObject::CreateNamed(name, 4096);
    ASSERT_TRUE(created.ok()) << created.status();
    ShmObject moved = *std::move(created);  // the moved-from object owns nothing
    EXPECT_TRUE(NameExists(name));
  }
  EXPECT_FALSE(NameExists(name));
}

TEST(ShmObjectTest, CreateRefusesATakenName) {
  const std::string name = UniqueName("taken");
  absl::StatusOr<ShmObject> first = ShmObject::CreateNamed(name, 4096);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<ShmObject> second = ShmObject::CreateNamed(name, 4096);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  EXPECT_TRUE(NameExists(name));  // the failed create did not remove the first one's name
}

TEST(ShmObjectTest, BadNamesAndSizesAreInvalidArgument) {
  for (const char* name : {"", "/", "no-slash", "/a/b"}) {
    EXPECT_EQ(ShmObject::CreateNamed(name, 4096).status().code(),
              absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(ShmObject::OpenNamed(name).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  EXPECT_EQ(ShmObject::CreateNamed(absl::StrCat("/", std::string(300, 'x')), 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmObject::CreateAnonymous("zero", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string name = UniqueName("zero");
  EXPECT_EQ(ShmObject::CreateNamed(name, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(NameExists(name));  // a failed create leaves no name behind
  EXPECT_EQ(ShmObject::Adopt(-1, "nothing").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmObjectTest, AnonymousObjectOpensThroughProc) {
  absl::StatusOr<ShmObject> created = ShmObject::CreateAnonymous("moed-test", 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  absl::StatusOr<ShmObject> opened =
      ShmObject::OpenPath(absl::StrCat("/proc/", getpid(), "/fd/", created->fd()));
  ASSERT_TRUE(opened.ok()) << opened.status();
  absl::StatusOr<ShmMapping> a = created->Map();
  absl::StatusOr<ShmMapping> b = opened->Map();
  ASSERT_TRUE(a.ok() && b.ok());
  a->data()[7] = 42;
  EXPECT_EQ(b->data()[7], 42);
  EXPECT_EQ(ShmObject::OpenPath("/proc/self/fd/100000").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ShmObjectTest, AdoptTakesTheFdsSize) {
  const int fd = memfd_create("adopt", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 12288), 0);
  absl::StatusOr<ShmObject> adopted = ShmObject::Adopt(fd, "adopt");
  ASSERT_TRUE(adopted.ok());
  EXPECT_EQ(adopted->size(), 12288u);
  adopted->Reset();
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);  // closed by Reset
  EXPECT_EQ(errno, EBADF);
}

TEST(ShmObjectTest, EmptyObjectIsNotMapped) {
  const int fd = memfd_create("empty", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  absl::StatusOr<ShmObject> adopted = ShmObject::Adopt(fd, "empty");
  ASSERT_TRUE(adopted.ok());
  EXPECT_EQ(adopted->Map().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmObjectTest, PermissionDenied) {
  EXPECT_EQ(ErrnoStatus(EACCES, "shm_open", "/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(EPERM, "shm_open", "/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(ENOENT, "shm_open", "/x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus(EINVAL, "mmap", "/x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ErrnoStatus(EACCES, "shm_open", "/x").message().find("shm_open(/x)"),
            absl::string_view::npos);
  // A real refusal, where the test does not run as root (root opens anything).
  const std::string name = UniqueName("denied");
  absl::StatusOr<ShmObject> created = ShmObject::CreateNamed(name, 4096);
  ASSERT_TRUE(created.ok());
  ASSERT_EQ(fchmod(created->fd(), 0), 0);
  if (geteuid() == 0) GTEST_SKIP() << "root opens a mode-0 object; the mapping is tested above";
  EXPECT_EQ(ShmObject::OpenNamed(name).status().code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace moe
