"""Engine parity as a pure function on arrays: tolerances, argmax agreement, integer outputs, trtexec's JSON;
and the ONNX Runtime recording it is checked against (a real tiny export)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge.core.errors import ArtifactError
from edge.jetson.parity import EPS, PRINT_RTOL, SAFETY, compare_graph, parse_trtexec_outputs, rtol
from edge.jetson.record import PARITY_JSON, load_recorded, record_parity


def trtexec_json(outputs: dict[str, np.ndarray]) -> str:
    """Text in the layout of trtexec --exportOutput (TensorRT samples/common/sampleReporting.cpp,
    exportJSONOutput: '[', '  { "name" : ...', '  , "dimensions" : "AxB"', '  , "values" : [ v, v ]', '  }', ']'),
    values printed with 6 significant digits like std::ostream. The values are this test's."""
    lines, sep = ["["], "  "
    for name, arr in outputs.items():
        vals = ", ".join(f"{v:.6g}" for v in np.asarray(arr).reshape(-1))
        lines += [f'{sep}{{ "name" : "{name}"', f'  , "dimensions" : "{"x".join(map(str, arr.shape))}"',
                  f'  , "values" : [ {vals} ]', "  }"]
        sep = ", "
    return "\n".join(lines + ["]"]) + "\n"


def test_rtol_follows_the_stated_rules():
    assert rtol("fp32", 64, 2) == pytest.approx(SAFETY * EPS["fp32"] * 8 * 2 + PRINT_RTOL)
    assert rtol("fp16", 4096, 3) == pytest.approx(SAFETY * EPS["fp16"] * 3 + PRINT_RTOL)  # independent of n
    assert rtol("int8", 64, 1) > rtol("fp16", 64, 1) > rtol("fp32", 64, 1)
    with pytest.raises(ValueError, match="fp8"):
        rtol("fp8", 64, 1)


def test_compare_passes_within_and_fails_beyond_tolerance():
    g = np.random.default_rng(0)
    ref = {"hidden_out": g.standard_normal((2, 3, 64)).astype(np.float32)}
    tol = rtol("fp16", 64, 2) * float(np.abs(ref["hidden_out"]).max())
    ok = compare_graph("segment_0", ref, {"hidden_out": ref["hidden_out"] + 0.5 * tol}, "fp16", 64, 2)
    assert ok.passed and ok.outputs[0].max_abs_diff == pytest.approx(0.5 * tol, rel=1e-3)
    bad = compare_graph("segment_0", ref, {"hidden_out": ref["hidden_out"] + 2 * tol}, "fp16", 64, 2)
    assert not bad.passed
    missing = compare_graph("segment_0", ref, {}, "fp16", 64, 2)
    assert not missing.passed and missing.outputs[0].detail == "missing from the engine"
    wrong = compare_graph("segment_0", ref, {"hidden_out": np.zeros((2, 3))}, "fp16", 64, 2)
    assert not wrong.passed and "shape" in wrong.outputs[0].detail


def test_argmax_and_tokens_on_clear_rows_only():
    logits = np.array([[[0.0, 5.0, 1.0]], [[2.0, 2.0 + 1e-6, 0.0]]], np.float32)  # row 1: a tie
    ref = {"logits": logits, "exit_token": np.array([[1], [1]], np.int64)}
    swapped = logits.copy()
    swapped[1, 0, :2] = swapped[1, 0, 1::-1]  # the tie flips: not a failure
    r = compare_graph("head", ref, {"logits": swapped, "exit_token": np.array([[1], [0]])}, "fp16", 3, 1)
    assert r.passed and (r.argmax_rows, r.argmax_agree) == (1, 1)
    wrong = logits.copy()
    wrong[0, 0] = [5.0, 0.0, 1.0]  # a clear row changes its argmax
    r = compare_graph("head", ref, {"logits": wrong, "exit_token": np.array([[0], [1]])}, "fp16", 3, 1)
    assert not r.passed and r.argmax_agree == 0


def test_parse_trtexec_outputs_round_trip_and_non_finite():
    arrs = {"logits": np.array([[[1.5, -2.25, 3.0]]], np.float32), "exit_token": np.array([[2]], np.int64)}
    got = parse_trtexec_outputs(trtexec_json(arrs))
    assert got["logits"].shape == (1, 1, 3) and np.array_equal(got["logits"], arrs["logits"])
    assert got["exit_token"].tolist() == [[2.0]]
    weird = '[\n  { "name" : "x"\n  , "dimensions" : "3"\n  , "values" : [ inf, -inf, -nan ]\n  }\n]\n'
    x = parse_trtexec_outputs(weird)["x"]
    assert np.isinf(x[:2]).all() and np.isnan(x[2])
    with pytest.raises(ArtifactError, match="4 values"):
        parse_trtexec_outputs('[{"name": "x", "dimensions": "3", "values": [1, 2, 3, 4]}]')
    with pytest.raises(ArtifactError, match="exportOutput"):
        parse_trtexec_outputs("Segmentation fault")


def test_recording_of_a_real_export_checks_against_itself(tiny_export, tmp_path):
    info = record_parity(tiny_export, tmp_path / "parity")
    assert load_recorded(tmp_path / "parity") == json.loads((tmp_path / "parity" / PARITY_JSON).read_text())
    assert set(info["graphs"]) == {"embed", "segment_0", "segment_1", "kvfill_1", "head"}
    seg = info["graphs"]["segment_1"]
    assert seg["inputs"]["past_key_2"]["shape"] == [2, 2, 5, 16]  # past from the prefill, through the same graphs
    assert seg["inputs"]["attn_mask"]["shape"] == [2, 1, 3, 8] and seg["layers"] == 2
    raw = (tmp_path / "parity" / seg["inputs"]["positions"]["file"]).read_bytes()
    assert np.frombuffer(raw, np.int64).reshape(2, 3).tolist() == [[5, 6, 7], [5, 6, 7]]  # trtexec --loadInputs
    for name, entry in info["graphs"].items():
        ref = {k: np.load(tmp_path / "parity" / v["file"]) for k, v in entry["outputs"].items()}
        back = parse_trtexec_outputs(trtexec_json(ref))  # what trtexec would print for a perfect engine
        r = compare_graph(name, ref, back, "fp32", info["reduction"], entry["layers"])
        assert r.passed, r.to_dict()
    head = {k: np.load(tmp_path / "parity" / v["file"]) for k, v in info["graphs"]["head"]["outputs"].items()}
    noisy = {**head, "logits": head["logits"] + 0.5 * np.abs(head["logits"]).max()}
    assert not compare_graph("head", head, noisy, "fp16", 64, 1).passed


def test_recording_refuses_a_missing_export(tmp_path):
    with pytest.raises(ArtifactError, match="graphs.json"):
        record_parity(tmp_path, tmp_path / "p")
    with pytest.raises(ArtifactError, match="jetson-push"):
        load_recorded(Path(tmp_path / "nothing"))
