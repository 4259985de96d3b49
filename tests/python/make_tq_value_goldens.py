"""Writes the golden frames of wire/src/tests/values/ (run by hand, with
TransferQueue 0.1.11's virtualenv):

    $TQ_VENV/bin/python tests/python/make_tq_value_goldens.py

For each case: TransferQueue's own encoder writes a PUT of one field over
three rows (or as many as the value has) (CASE.put.frameK.bin) and a real SimpleStorageUnit, in this
process, answers a GET of those rows (CASE.get.frameK.bin). The wire crate's
test decodes each PUT as stowd does and encodes the GET reply with the same
sender, id and time: it must equal SimpleStorageUnit's reply byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import zmq
from tensordict import TensorDict

from transfer_queue.storage import SimpleStorageUnit
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

OUT = Path(__file__).resolve().parents[2] / "wire" / "src" / "tests" / "values"
INDEXES = [0, 1, 2]


def cases() -> dict:
    return {
        "numpy_rows": [np.arange(3, dtype=np.float32), np.array([[1, 2], [3, 4]], dtype=">i4"),
                       np.array([], dtype=np.int16)],
        "numpy_string_rows": [np.array(["ab", "c"]), np.array([b"x", b""], dtype="S3"),
                              np.array(5, dtype=np.uint8)],
        "numpy_empty_rows": [np.zeros((0, 3)), np.zeros((2, 0), dtype=bool), np.array([True])],
        "numpy_more_dtypes": [np.array([1 + 2j], dtype=np.complex64), np.array([1.5], dtype=np.float16),
                              np.array(["2020-01-01"], dtype="datetime64[ns]")],
        "numpy_structured_rows": [np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]), None,
                                  np.array([7], dtype=np.uint64)],
        "numpy_field_1d_bytes": np.array([b"bs_0", b"bs_1\x00x", b""], dtype="|S10"),
        "numpy_field_1d_str": np.array(["a", "", "ccc"]),
        "numpy_field_1d_str_be": np.array(["a", "", "ccc"], dtype=">U3"),
        "numpy_field_1d_f64": np.array([1.5, -2.0, 3.25]),
        "numpy_field_1d_i8": np.array([-1, 0, 127], dtype=np.int8),
        "numpy_field_1d_bool": np.array([True, False, True]),
        "numpy_field_1d_be_i4": np.array([1, -2, 3], dtype=">i4"),
        "numpy_field_1d_u64": np.array([0, 2**64 - 1, 300], dtype=np.uint64),
        "numpy_field_1d_c64": np.array([1 + 2j, 0, -1j], dtype=np.complex64),
        "numpy_field_1d_f16": np.array([1, 2, 3], dtype=np.float16),
        "numpy_field_2d": np.arange(6, dtype=np.int32).reshape(3, 2),
        "numpy_field_3d_str": np.array([["a", "bb"], ["c", "d"], ["e", "ffff"]]).reshape(3, 1, 2),
        "numpy_field_empty_rows": np.zeros((3, 0), dtype=np.float32),
        "tensor_in_containers": [[torch.ones(2), 3], {"a": torch.zeros(1, 2), "b": "x"}, None],
        "tensor_and_none": [torch.arange(3), None, torch.ones(1, dtype=torch.bfloat16)],
        "scalar_tensors_and_values": [torch.tensor(1.5), None, 2],
        "nested_tensor_row": [torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)], layout=torch.jagged),
                              None, "x"],
        "numpy_object_field_str": np.array(["obj_0", "obj_1", "obj_2"], dtype=object),
        "numpy_object_field_mixed": np.array([1, None, "x"], dtype=object),
        "numpy_object_field_scalars": np.array([1.5, True, b"z"], dtype=object),
        "numpy_object_field_shared": np.array(["same"] * 2 + [-(2**40)], dtype=object),
        "numpy_object_field_big": np.array([f"s{i % 7}" if i % 3 else i for i in range(1500)], dtype=object),
        "tensordict_field": TensorDict({"x": torch.arange(6).reshape(3, 2),
                                        "y": TensorDict({"z": torch.ones(3)}, [3])}, [3]),
        "tensordict_field_2d_batch": TensorDict({"a": torch.arange(24, dtype=torch.float16).reshape(3, 2, 4),
                                                 "e": torch.zeros(3, 2, 0)}, [3, 2]),
        "numpy_in_dict": [{"arr": np.arange(2), "s": np.array(["q"])}, [np.zeros(1), None], "plain"],
    }


def request(sock, request_type, body):
    msg = ZMQMessage.create(request_type=request_type, sender_id="TQ_STORAGE_golden", receiver_id="U", body=body)
    frames = msg.serialize()
    sock.send_multipart(frames, copy=False)
    return frames, sock.recv_multipart()


def save(name: str, frames):
    for k, f in enumerate(frames):
        (OUT / f"{name}.frame{k}.bin").write_bytes(bytes(memoryview(f)))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.bin"):
        old.unlink()
    unit = SimpleStorageUnit.__ray_metadata__.modified_class(config={"num_data_storage_units": 1})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"TQ_STORAGE_golden_0")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(unit.zmq_server_info.to_addr("put_get_socket"))
    names = []
    for name, value in cases().items():
        indexes = INDEXES if len(value) == 3 else list(range(len(value)))
        put, reply = request(sock, ZMQRequestType.PUT_DATA, {"global_indexes": indexes, "data": {"f": value},
                                                             "data_parser": None})
        kind = ZMQMessage.deserialize(reply).request_type
        if kind != ZMQRequestType.PUT_DATA_RESPONSE:
            print(f"{name}: SimpleStorageUnit refused the PUT ({kind}); skipped", file=sys.stderr)
            continue
        _, got = request(sock, ZMQRequestType.GET_DATA, {"global_indexes": indexes, "fields": ["f"]})
        save(f"{name}.put", put)
        save(f"{name}.get", got)
        request(sock, ZMQRequestType.CLEAR_DATA, {"global_indexes": indexes})
        names.append(name)
    (OUT / "CASES").write_text("".join(f"{n}\n" for n in names))
    print(f"{len(names)} cases in {OUT}")
    sock.close(0)
    unit.shutdown()
    ctx.term()


if __name__ == "__main__":
    main()
