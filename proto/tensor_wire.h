// Step messages written and read around their tensor's bytes, so that neither side copies
// the bytes more than once. A Forward/Backward request or answer is a few dozen bytes of
// fields plus one big moe.v1.Tensor; protobuf's generated code copies that tensor's raw_data
// on every hop (into the message, into the wire buffer; out of the wire buffer, into the
// engine tensor). Here a message is sent as a grpc::ByteBuffer of two slices:
//
//   [ header: the message's other fields, the tensor field's tag and length, the tensor's
//     datatype and shape, raw_data's tag and length ][ the tensor's bytes, not copied ]
//
// which is exactly the protobuf encoding of the message (a parser cannot tell the
// difference), and a received message is split into its fields (parsed by protobuf from a
// copy of the few header bytes) and its raw_data (pieces of the received slices, copied once,
// straight into the engine tensor). Used by the C++ client, moed's worker calls and the
// worker's Forward/Backward handlers.
//
//   BorrowedBytes borrowed;  // declared after x: waits for gRPC to let go of x's bytes
//   grpc::ByteBuffer wire = EncodeWithTensor(head, /*tensor_field=*/2, TensorHead(x),
//                                            borrowed.Borrow(x.bytes()));
//   grpc::ByteBuffer answer;
//   RETURN_IF_ERROR(CallUnary(channel, &context, "/moe.v1.MoeService/Forward", wire, &answer));
//   v1::ForwardResponse response;
//   TensorBytes out_bytes;
//   RETURN_IF_ERROR(DecodeWithTensor(answer, /*tensor_field=*/1, &response, &out_bytes));
//   ASSIGN_OR_RETURN(Tensor out, TensorFromWire("out", response.out(), out_bytes));
#ifndef MOED_PROTO_TENSOR_WIRE_H_
#define MOED_PROTO_TENSOR_WIRE_H_

#include <grpcpp/grpcpp.h>

#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/tensor.h"
#include "google/protobuf/message_lite.h"
#include "proto/moe.pb.h"

namespace moe {

// ---- sending ----

// Slices that borrow caller-owned bytes. gRPC may hold a slice a little past the end of the
// call (a socket write in flight when a call is cancelled), so the destructor blocks until
// every borrowed slice was released: declare it after (so that it is destroyed before) the
// object that owns the bytes.
class BorrowedBytes {
 public:
  BorrowedBytes() = default;
  BorrowedBytes(const BorrowedBytes&) = delete;
  BorrowedBytes& operator=(const BorrowedBytes&) = delete;
  ~BorrowedBytes();

  // A slice over `bytes` (not copied; gRPC only reads it).
  grpc::Slice Borrow(absl::string_view bytes);

 private:
  static void Release(void* self);

  absl::Mutex mu_;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

// A slice that owns `tensor` and points at its bytes (not copied): the tensor is freed when
// gRPC releases the slice.
grpc::Slice TakeTensorBytes(Tensor tensor);

// `tensor`'s datatype and shape (no raw_data).
v1::Tensor TensorHead(const Tensor& tensor);

// The encoding of `head` with field `tensor_field` (a moe.v1.Tensor, absent from `head`) set
// to `tensor_head` (datatype and shape, no raw_data) plus raw_data = the bytes of `bytes`
// (from BorrowedBytes::Borrow or TakeTensorBytes), which the buffer references.
grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, grpc::Slice bytes);
// The same with raw_data = the concatenation of `bytes` (e.g. TensorBytes::AppendSlices of
// several received answers): still no copy.
grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, std::vector<grpc::Slice> bytes);

// `message` encoded into one slice (a call without tensor bytes, e.g. shared-memory steps).
grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message);

// ---- receiving ----

// A tensor's raw_data as it arrived: views of one or more received slices (which it keeps
// alive; copying it keeps them too), or of a string the caller keeps alive. Not copied until
// CopyTo.
class TensorBytes {
 public:
  TensorBytes() = default;
  // A view of `bytes` (e.g. a parsed message's raw_data), which must outlive this.
  explicit TensorBytes(absl::string_view bytes);

  size_t size() const { return size_; }
  // Writes the size() bytes to `dst`.
  void CopyTo(void* dst) const;
  // Appends to *out slices over bytes [offset, offset + length) (within size()), not copied:
  // references to the received slices, which keep them alive on their own (no wait at the
  // end of a call), or, for a view of caller-owned bytes, slices borrowed through *borrowed
  // (with copy_views: copies of those bytes, owned by the slices; `borrowed` is not used).
  void AppendSlices(size_t offset, size_t length, BorrowedBytes* borrowed,
                    std::vector<grpc::Slice>* out, bool copy_views = false) const;
  // The bytes of `parts` one after another: references to their received slices, which the
  // result keeps alive by itself (a part may be destroyed first); views of caller-owned bytes
  // are copied, since their owner may not outlive the result.
  static TensorBytes Concat(const std::vector<TensorBytes>& parts);

 private:
  friend absl::Status DecodeWithTensor(const grpc::ByteBuffer&, int, google::protobuf::MessageLite*,
                                       TensorBytes*, std::initializer_list<int>);

  std::shared_ptr<const std::vector<grpc::Slice>> slices_;  // what pieces_ point into
  std::vector<absl::string_view> pieces_;
  std::vector<int> piece_slice_;  // the slice of slices_ each piece lies in, or < 0
  size_t size_ = 0;
};

// Splits a received message: `head` gets every field as protobuf would parse them except the
// raw_data of the moe.v1.Tensor field `tensor_field`, whose bytes go to *raw_data (empty when
// the message has none). Protobuf's rules hold for the bytes too: the last raw_data wins, and
// a field of `tensor_oneof` (the other members of the tensor field's oneof) clears them.
// Anything protobuf would not parse is INVALID_ARGUMENT.
absl::Status DecodeWithTensor(const grpc::ByteBuffer& wire, int tensor_field,
                              google::protobuf::MessageLite* head, TensorBytes* raw_data,
                              std::initializer_list<int> tensor_oneof = {});

// TensorFromProto (proto/tensor_convert.h: same checks, same errors) of `head` with raw_data
// = `raw_data` (head's own raw_data is not read): the one copy of the bytes. With `into`, the
// bytes go into *into (which must have the tensor's datatype and shape: CheckTensorFits, an
// error naming `into_name`) instead of a new tensor, and the result is a view of *into.
absl::StatusOr<Tensor> TensorFromWire(absl::string_view field, const v1::Tensor& head,
                                      const TensorBytes& raw_data, Tensor* into = nullptr,
                                      absl::string_view into_name = "output");

// ---- calling ----

// A blocking unary call of `method` (e.g. "/moe.v1.MoeService/Forward") with an encoded
// request; the answer's bytes in *answer. Cancellation and deadline come from `context`, as
// with a stub; the status is the call's.
absl::Status CallUnary(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                       const char* method, const grpc::ByteBuffer& request,
                       grpc::ByteBuffer* answer);

}  // namespace moe

#endif  // MOED_PROTO_TENSOR_WIRE_H_
