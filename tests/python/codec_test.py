"""Tensor codecs (client/python/moe_client/codec.py), without a server: fp32/bf16/fp64/int
round trips through the wire message, bf16 rounding identical to torch's (round to nearest
even, NaN kept), zero-copy numpy decoding, byte-count checks, chunking of large tensors; and
the step messages written and read around their tensor's bytes (wire.py): what protobuf parses
from them, what they read from protobuf's encoding, no copy on either side."""

import unittest

import numpy as np
import torch

from moe_client import codec, wire
from moe_client.proto import moe_pb2


class CodecTest(unittest.TestCase):

    def test_numpy_round_trips_are_exact(self):
        rng = np.random.default_rng(0)
        for dtype, name in ((np.float32, "FP32"), (np.float64, "FP64"), (np.int32, "INT32"),
                            (np.int64, "INT64")):
            a = (rng.standard_normal((3, 5)) * 100).astype(dtype)
            t = codec.to_proto(a)
            self.assertEqual((t.datatype, list(t.shape)), (name, [3, 5]))
            self.assertEqual(len(t.raw_data), a.nbytes)
            np.testing.assert_array_equal(codec.to_numpy(t), a)

    def test_numpy_decode_is_a_view_of_the_message(self):
        t = codec.to_proto(np.arange(6, dtype=np.float32).reshape(2, 3))
        a = codec.to_numpy(t)
        self.assertFalse(a.flags.writeable)
        self.assertFalse(a.flags.owndata)  # np.frombuffer: no copy

    def test_bf16_rounding_matches_torch(self):
        rng = np.random.default_rng(1)
        values = np.concatenate([
            rng.standard_normal(10000).astype(np.float32) * 10,
            # exact ties between two bf16 values: round half to even
            (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40], np.float32),
        ])
        ours = codec.to_torch(codec.to_proto(values, "BF16"))
        theirs = torch.from_numpy(values).to(torch.bfloat16)
        self.assertEqual(ours.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(ours.view(torch.int16), theirs.view(torch.int16)))
        nan = codec.to_numpy(codec.to_proto(np.array([np.nan], np.float32), "BF16"))
        self.assertTrue(np.isnan(nan[0]))

    def test_torch_bf16_and_fp32_round_trip(self):
        x = torch.randn(4, 7)
        for value in (x, x.bfloat16()):
            back = codec.to_torch(codec.to_proto(value))
            self.assertEqual(back.dtype, value.dtype)
            self.assertTrue(torch.equal(back, value))
            back += 1  # writable by default (a copy)
        self.assertEqual(codec.to_proto(x.bfloat16()).datatype, "BF16")
        self.assertEqual(codec.to_numpy(codec.to_proto(x.bfloat16())).dtype, np.float32)

    def test_wrong_byte_count_is_an_error(self):
        t = moe_pb2.Tensor(datatype="FP32", shape=[2, 2], raw_data=b"\0" * 12)
        with self.assertRaisesRegex(ValueError, "needs 16 bytes, got 12"):
            codec.to_numpy(t)
        with self.assertRaisesRegex(ValueError, "unknown datatype"):
            codec.to_numpy(moe_pb2.Tensor(datatype="FP8", shape=[1], raw_data=b"\0"))
        with self.assertRaises(TypeError):
            codec.to_proto(np.zeros(3, np.float16))

    def test_decode_into_writes_what_to_numpy_returns(self):
        # decode_into fills a caller's array with exactly to_numpy's values (BF16 converted to
        # fp32, or kept as bit patterns), whole or as a row range; check_output refuses what
        # it could not fill.
        rng = np.random.default_rng(3)
        values = rng.standard_normal((5, 6)).astype(np.float32)
        for datatype in ("FP32", "BF16"):
            t = codec.to_wire(values, datatype)
            out = np.full((5, 6), np.nan, np.float32)
            codec.check_output(out, datatype, [5, 6])
            codec.decode_into(t, out)
            self.assertEqual(out.tobytes(), codec.to_numpy(t).tobytes())
            rows = np.full((5, 6), np.nan, np.float32)
            codec.decode_into(t.rows(2, 5), rows, 2)
            codec.decode_into(t.rows(0, 2), rows, 0)
            self.assertEqual(rows.tobytes(), out.tobytes())
        bf16 = codec.to_wire(values, "BF16")
        bits = np.zeros((5, 6), np.uint16)
        codec.check_output(bits, "BF16", [5, 6], keep_bf16_bits=True)
        codec.decode_into(bf16, bits, keep_bf16_bits=True)
        self.assertEqual(bits.tobytes(), bytes(bf16.raw_data))
        with self.assertRaisesRegex(ValueError, "dtype uint16.*needs float32"):
            codec.check_output(bits, "BF16", [5, 6])
        with self.assertRaisesRegex(ValueError, "cannot decode BF16 into an array of float32"):
            codec.decode_into(bf16, out, keep_bf16_bits=True)
        with self.assertRaisesRegex(ValueError, "shape"):
            codec.check_output(np.zeros((6, 5), np.float32), "FP32", [5, 6])
        with self.assertRaisesRegex(ValueError, "C-contiguous"):
            codec.check_output(np.zeros((6, 5), np.float32).T, "FP32", [5, 6])
        with self.assertRaisesRegex(ValueError, "read-only"):
            codec.check_output(codec.to_numpy(codec.to_proto(values)), "FP32", [5, 6])
        with self.assertRaisesRegex(TypeError, "numpy array"):
            codec.check_output(torch.zeros(5, 6), "FP32", [5, 6])

    def test_chunks_cover_the_tensor_in_order(self):
        a = np.random.default_rng(2).standard_normal((5, 7, 3)).astype(np.float32)
        chunks = list(codec.chunks_of("wi", a, max_chunk_bytes=40))
        self.assertEqual(len(chunks), -(-a.nbytes // 40))
        self.assertTrue(all(len(c.raw_data) <= 40 for c in chunks))
        out = codec.assemble_chunks(chunks + list(codec.chunks_of("empty", np.zeros((0, 3),
                                                                                   np.float32))))
        np.testing.assert_array_equal(out["wi"], a)
        self.assertEqual(out["empty"].shape, (0, 3))
        with self.assertRaisesRegex(ValueError, "starts at element"):
            codec.assemble_chunks([chunks[0], chunks[2]])


class WireTest(unittest.TestCase):

    def test_encoding_parses_as_the_protobuf_message(self):
        for value in (np.arange(12, dtype=np.float32).reshape(3, 4),
                      torch.randn(5, 2).bfloat16(), np.zeros((0, 4), np.float32)):
            request = moe_pb2.ForwardRequest(layer="l0", keep_for_backward=True, timing=True)
            data = wire.encode_with_tensor(request, "x", codec.to_wire(value))
            parsed = moe_pb2.ForwardRequest.FromString(data)
            expected = moe_pb2.ForwardRequest()
            expected.CopyFrom(request)
            expected.x.CopyFrom(codec.to_proto(value))
            self.assertEqual(parsed, expected)

    def test_to_wire_shares_the_callers_memory(self):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        t = codec.to_wire(a)
        self.assertTrue(np.shares_memory(np.asarray(t.raw_data), a))
        self.assertEqual((t.datatype, t.shape, t.nbytes), ("FP32", [2, 3], 24))
        rows = t.rows(1, 2)
        self.assertEqual(rows.shape, [1, 3])
        np.testing.assert_array_equal(np.frombuffer(rows.raw_data, np.float32), a[1])

    def test_decoding_reads_protobufs_encoding_without_copying(self):
        out = np.arange(8, dtype=np.float32).reshape(2, 4)
        answer = moe_pb2.ForwardResponse(aux_loss=0.5, z_loss=0.25, tokens_per_expert=[3, 1],
                                         step_id=7, out=codec.to_proto(out))
        data = answer.SerializeToString()
        message, tensor = wire.decode_with_tensor(data, moe_pb2.ForwardResponse, "out")
        expected = moe_pb2.ForwardResponse()
        expected.CopyFrom(answer)
        expected.ClearField("out")
        self.assertEqual(message, expected)
        self.assertEqual((tensor.datatype, tensor.shape), ("FP32", [2, 4]))
        decoded = codec.to_numpy(tensor)
        np.testing.assert_array_equal(decoded, out)
        self.assertTrue(np.shares_memory(decoded, np.frombuffer(data, np.uint8)))
        # An answer without the tensor, and one repeating it (protobuf merges: parsed whole).
        _, empty = wire.decode_with_tensor(b"", moe_pb2.ForwardResponse, "out")
        self.assertEqual((empty.datatype, empty.shape, empty.nbytes), ("", [], 0))
        twice = data + moe_pb2.ForwardResponse(out=moe_pb2.Tensor(shape=[2, 4])).SerializeToString()
        _, merged = wire.decode_with_tensor(twice, moe_pb2.ForwardResponse, "out")
        self.assertEqual(merged.shape, [2, 4, 2, 4])  # repeated shape entries are appended

    def test_malformed_answers_are_value_errors(self):
        data = moe_pb2.ForwardResponse(step_id=1, out=codec.to_proto(
            np.ones((2, 2), np.float32))).SerializeToString()
        with self.assertRaises(ValueError):
            wire.decode_with_tensor(data[:-3], moe_pb2.ForwardResponse, "out")
        with self.assertRaises(ValueError):
            wire.decode_with_tensor(b"\x0f\x00", moe_pb2.ForwardResponse, "out")  # wire type 7
        with self.assertRaises(ValueError):
            wire.decode_with_tensor(b"\x28\x80", moe_pb2.ForwardResponse, "out")  # cut varint


if __name__ == "__main__":
    unittest.main(verbosity=2)
