"""Every `torch_npu.<op>(...)` call in the repository names an op of npu_schemas.txt and binds to its schema.

npu_schemas.txt is generated from the torch_npu 2.14.0 wheel by scripts/npu_schemas.py; no wheel, no hardware here.
"""
from pathlib import Path

import pytest
import torch

from common.ops.schema import SCHEMA_FILE, bind, find_torch_npu_calls, load_schemas

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = load_schemas()
CALLS = find_torch_npu_calls(ROOT)


def static_bind(call):
    bind(SCHEMAS[call.op], [...] * call.n_positional, {k: ... for k in call.keywords}, check_types=False)


def test_schema_file_names_the_wheel():
    header = SCHEMA_FILE.read_text().splitlines()[:2]
    assert header[0].startswith("# torch_npu 2.14.0 ") and "npu_native_functions_by_codegen.yaml" in header[1]


def test_the_npu_implementations_are_scanned():
    in_npu_py = {c.op for c in CALLS if c.path.name == "npu.py" and c.path.parent.name == "ops"}
    assert {"npu_rms_norm", "npu_fused_infer_attention_score", "npu_moe_init_routing_v2"} <= in_npu_py


def test_schema_file_lists_exactly_the_called_ops():
    called = {c.op for c in CALLS}
    assert called == set(SCHEMAS), "regenerate with: python scripts/npu_schemas.py"


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.path.relative_to(ROOT)}:{c.line}:{c.op}")
def test_call_binds_to_its_schema(call):
    assert call.op in SCHEMAS, f"torch_npu.{call.op} is not a torch_npu 2.14.0 op"
    assert not call.starred, "pass torch_npu arguments explicitly, not through *args / **kwargs"
    static_bind(call)


def test_scanner_and_binder_reject_bad_calls(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import torch_npu\n"
        "torch_npu.npu_rms_norm(x, w, 1e-6, 2)\n"  # too many positional
        "torch_npu.npu_fused_infer_attention_score(q, k, v, 8)\n"  # keyword-only passed positionally
        "torch_npu.npu_swiglu(x, dims=-1)\n"  # unknown keyword
        "torch_npu.npu_moe_finalize_routing(rows, scales=w, expanded_src_to_dst_row=i)\n"  # skip1 etc. missing
        "torch_npu.npu_rotary_mul(self=x, r1=c, r2=s)\n"  # `self` is spelled `input`
        "torch_npu.npu_rotary_mul(input=x, r1=c, r2=s)\n"  # fine
    )
    calls = find_torch_npu_calls(tmp_path)
    assert [c.line for c in calls] == [2, 3, 4, 5, 6, 7]
    for call in calls[:-1]:
        with pytest.raises(TypeError):
            static_bind(call)
    static_bind(calls[-1])


def test_runtime_binding_checks_types():
    x = torch.zeros(2, 4)
    overloads = SCHEMAS["npu_fused_infer_attention_score"]
    with pytest.raises(TypeError, match="actual_seq_lengths"):
        bind(overloads, [x, x, x], {"actual_seq_lengths": torch.tensor([2])})  # SymInt[] wants a list of ints
    bound = bind(overloads, [x, x, x], {"actual_seq_lengths": [2], "num_heads": 4})
    assert bound["num_heads"] == 4 and bound["input_layout"] == "BSH" and bound["block_table"] is None
