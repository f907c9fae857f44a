"""llama.cpp peer (edge/pipeline/bench/llamacpp.py, llamacpp_peer.py, llamacpp_repack.py, llamacpp_match.py,
llamacpp_gguf.py, llamacpp_tokenizer.py): tokenizer inspection and command lines everywhere; conversion,
tokenizer agreement and greedy agreement where `make llamacpp` has installed it."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from edge.pipeline.bench import llamacpp as lc
from edge.pipeline.bench import llamacpp_gguf as gg
from edge.pipeline.bench import llamacpp_match as lm
from edge.pipeline.bench import llamacpp_peer as lp
from edge.pipeline.bench import llamacpp_repack as lr
from edge.pipeline.bench import llamacpp_timing as lt
from edge.pipeline.bench import llamacpp_tokenizer as tk
from edge.model.bundled import BUNDLED_DIR, BUNDLED_EE_DIR
from edge.core.errors import SmartExitError

REASON = lc.available()
needs_llamacpp = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def ours() -> dict:
    return json.loads((BUNDLED_EE_DIR / "tokenizer.json").read_text())


@pytest.fixture
def one_torch_thread():
    """Reference decodes of the tiny model are small matmuls: one thread is faster than two and does not
    slow down tenfold when other work holds the cores (threads waiting for each other)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ pure: tokenizer.json inspection
@pytest.mark.parametrize("folder", [BUNDLED_DIR, BUNDLED_EE_DIR], ids=["bundled", "bundled-ee"])
def test_bundled_tokenizers_are_gpt2_byte_level(folder: Path):
    assert tk.gpt2_byte_level_mismatch(folder / "tokenizer.json") is None
    assert tk.tokenizer_is_gpt2_byte_level(folder)


def _metaspace(tj):
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}


def _sequence(tj):
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [tj["pre_tokenizer"]]}


def _no_regex(tj):
    tj["pre_tokenizer"]["use_regex"] = False


def _prefix_space(tj):
    tj["pre_tokenizer"]["add_prefix_space"] = True


def _normalizer(tj):
    tj["normalizer"] = {"type": "NFC"}


def _byte_fallback(tj):
    tj["model"]["byte_fallback"] = True


def _wordpiece_decoder(tj):
    tj["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}


def _template(tj):
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}


def _foreign_token(tj):
    tj["model"]["vocab"]["▁the"] = len(tj["model"]["vocab"])  # SentencePiece's space, not a GPT-2 byte


def _unigram(tj):
    tj["model"]["type"] = "Unigram"


@pytest.mark.parametrize("change, says", [
    (_metaspace, "Metaspace"), (_sequence, "Sequence"), (_no_regex, "use_regex"), (_prefix_space, "prefix space"),
    (_normalizer, "normalizer"), (_byte_fallback, "byte fallback"), (_wordpiece_decoder, "WordPiece"),
    (_template, "TemplateProcessing"), (_foreign_token, "byte alphabet"), (_unigram, "Unigram"),
])
def test_other_tokenizers_are_not_declared_gpt2(ours, change, says):
    tj = copy.deepcopy(ours)
    change(tj)
    why = tk.gpt2_byte_level_mismatch(tj)
    assert why is not None and says in why
    assert not tk.tokenizer_is_gpt2_byte_level(tj)


def test_gpt2_byte_alphabet_is_a_bijection_onto_printable_characters():
    table = tk.bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"  # GPT-2's spellings


def test_unreadable_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(SmartExitError, match="tokenizer.json"):
        tk.tokenizer_is_gpt2_byte_level(tmp_path)


# ------------------------------------------------------------------ pure: command lines, cache keys, matching
def test_convert_argv():
    argv = gg.convert_argv("m", "out.gguf", "f32", Path("/src/vendor/llama.cpp"), True, python="py")
    assert argv == ["py", "-m", "edge.pipeline.bench.llamacpp_gguf",
                    "_convert", "--converter-dir", "/src/vendor/llama.cpp",
                    "--gpt2-pre-if-unknown", "--", "m", "--outtype", "f32", "--outfile", "out.gguf"]
    assert "--gpt2-pre-if-unknown" not in gg.convert_argv("m", "o", "q8_0", Path("c"), False)


def test_converter_is_looked_for_where_make_llamacpp_unpacks_it(monkeypatch, tmp_path):
    monkeypatch.setenv(lc.SRC_ENV, str(tmp_path / "nowhere"))
    assert lc.converter_dir() == tmp_path / "nowhere" / "vendor" / "llama.cpp"
    reason = lc.available()
    assert reason is not None and "make llamacpp" in reason
    with pytest.raises(SmartExitError, match="make llamacpp"):
        lc.require_available()


def test_conversion_wants_a_gguf_file_path(tmp_path, monkeypatch):
    monkeypatch.setattr(gg, "require_available", lambda: None)
    with pytest.raises(SmartExitError, match="must name a .gguf file"):
        gg.convert_to_gguf(BUNDLED_EE_DIR, tmp_path / "llamacpp")
    with pytest.raises(SmartExitError, match="outtype"):
        gg.convert_to_gguf(BUNDLED_EE_DIR, tmp_path / "m.gguf", outtype="q4_k")


def test_gguf_cache_key_names_checkpoint_hash_version_and_type(monkeypatch, tmp_path):
    from edge.core.artifacts import sha256_path

    monkeypatch.setattr(gg, "llamacpp_version", lambda: "9.9.9")
    p = gg.gguf_path(tmp_path, BUNDLED_EE_DIR, "q8_0")
    assert p == tmp_path / "llamacpp" / f"{sha256_path(BUNDLED_EE_DIR)[:16]}-llama-cpp-python-9.9.9-q8_0.gguf"
    assert gg.gguf_path(tmp_path, BUNDLED_DIR, "q8_0") != p  # other weights, other file


class _FakePeer:
    gguf = Path("fake.gguf")

    def __init__(self, outputs):
        self.outputs = iter(outputs)

    def generate(self, prompt, n):
        return lt.PeerGeneration(next(self.outputs)[:n], 0.0, [])


def test_greedy_match_fraction_and_refusal():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert lm.check_greedy_match(_FakePeer(ref), ref, [[0], [0]]) == 1.0
    assert lm.check_greedy_match(_FakePeer([[1, 2, 3, 4], [5, 6, 0, 0]]), ref, [[0], [0]]) == pytest.approx(0.75)
    with pytest.raises(lm.GreedyMismatch, match="75.0%"):
        lm.require_greedy_match(_FakePeer([[1, 2, 3, 4], [5, 6, 0, 0]]), ref, [[0], [0]])
    with pytest.raises(SmartExitError, match="reference"):
        lm.check_greedy_match(_FakePeer(ref), ref, [[0]])


def test_reference_greedy_matches_transformers(llama_dir, one_torch_thread):
    """Our reference decoder loop (K/V cache) gives transformers' greedy tokens on the same weights."""
    import torch
    import transformers

    prompts = [[5, 17, 42, 7, 99, 3], [250, 1, 1, 8, 64, 31]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                                        eos_token_id=None)
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(2, 6, dtype=torch.long),
                           generation_config=gen)[:, 6:].tolist()
    assert lm.reference_greedy(llama_dir, prompts, 12) == want


# ------------------------------------------------------------------ whether repacked weights run (no llama.cpp needed)
def _children(monkeypatch, tmp_path, crash: set[bool]) -> list[bool]:
    """Stand-in probe children: a Python that dies of SIGSEGV (as llama.cpp's repacked q8_0 kernels did) for
    the repack flags in ``crash`` and exits 0 otherwise; returns the flags the children were started with."""
    started: list[bool] = []

    def argv(gguf, threads, repack):
        started.append(repack)
        code = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)" if repack in crash else "pass"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(lr, "probe_argv", argv)
    monkeypatch.setattr(lr, "_REPACK", {})
    return started


def test_repacking_is_probed_apart_and_dropped_where_it_crashes(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    started = _children(monkeypatch, tmp_path, crash={True})
    assert lr.repack_runs(gguf, 2) is False  # this process survived its child's crash
    assert started == [True, False]
    assert lr.repack_runs(gguf, 2) is False and started == [True, False]  # cached per file
    gguf.write_bytes(b"GGUF v2")  # another file there: probed again
    assert lr.repack_runs(gguf, 2) is False and started == [True, False, True, False]

    started = _children(monkeypatch, tmp_path, crash=set())
    assert lr.repack_runs(gguf, 2) is True and started == [True]  # llama.cpp's default where it runs


def test_a_gguf_llamacpp_cannot_decode_either_way_is_a_clear_error(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _children(monkeypatch, tmp_path, crash={True, False})
    with pytest.raises(SmartExitError, match=r"with repacking: signal 11.*without repacking: signal 11"):
        lr.repack_runs(gguf, 2)
    with pytest.raises(SmartExitError, match="does not exist"):
        lr.repack_runs(tmp_path / "missing.gguf", 2)


def test_a_probe_that_hangs_counts_as_failing_that_way(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(lr, "_REPACK", {})
    monkeypatch.setattr(lr, "probe_argv", lambda g, t, repack: [sys.executable, "-c",
                                                                "import time; time.sleep(30)" if repack else "pass"])
    assert lr.repack_runs(gguf, 2, timeout=1.0) is False
    monkeypatch.setattr(lr, "_REPACK", {})
    monkeypatch.setattr(lr, "probe_argv", lambda g, t, repack: [sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(SmartExitError, match="with repacking: no answer in 1 s.*without repacking: no answer"):
        lr.repack_runs(gguf, 2, timeout=1.0)


def test_probe_child_command():
    argv = lr.probe_argv("/m.gguf", 2, False)
    assert argv[:3] == [sys.executable, "-m", "edge.pipeline.bench.llamacpp_peer"]
    assert argv[3:] == ["probe", "/m.gguf", "2", "no-repack"] and lr.probe_argv("/m.gguf", 2, True)[-1] == "repack"


# ------------------------------------------------------------------ llama.cpp itself (after `make llamacpp`)
@needs_llamacpp
def test_repacking_switch_reaches_the_model_parameters():
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params
    assert default().use_extra_bufts  # llama.cpp's default: repacked
    with lr.model_params(False):
        assert not lib.llama_model_default_params().use_extra_bufts
    assert lib.llama_model_default_params is default



@needs_llamacpp
@pytest.mark.slow
def test_bundled_ee_converts_tokenizes_and_decodes_like_ours(tmp_path, one_torch_thread):
    from edge.core.data import Split, heldout_prompts, load_split
    from edge.model.tokenizer import load_tokenizer

    gguf = gg.convert_to_gguf(BUNDLED_EE_DIR, tmp_path / "tiny-ee-f32.gguf", "f32")
    assert gguf.is_file() and [p.name for p in tmp_path.iterdir()] == [gguf.name]  # nothing half-written beside it
    prompts = heldout_prompts(load_tokenizer(BUNDLED_EE_DIR), load_split(Split.TEST), 2, 64, seed=0)
    ref = lm.reference_greedy(BUNDLED_EE_DIR, prompts, 32)
    with lp.LlamaCppPeer(gguf, threads=1) as peer:  # correctness here, not speed
        assert tk.verify_tokenizer(BUNDLED_EE_DIR, peer) == len(tk.verification_texts())
        assert lm.check_greedy_match(peer, ref, prompts) == 1.0
        run = peer.generate(prompts[0], 32)
        assert run.tokens == ref[0] and len(run.token_latencies) == 31
        assert 0 < sum(run.token_latencies) < run.seconds  # the call also holds the prefill


def test_our_token_bytes_spell_every_text():
    """The byte table verify_tokenizer compares llama.cpp's vocabulary against decodes our ids losslessly."""
    from edge.model.tokenizer import load_tokenizer

    tok, pieces = load_tokenizer(BUNDLED_EE_DIR), tk.our_token_bytes(BUNDLED_EE_DIR)
    assert len(pieces) == tok.get_vocab_size() and pieces[0] == b"<|endoftext|>"
    for text in tk.EDGE_CASES + ("def f(x):\n\t    return {'a': x}  # ünïcode\n",):
        assert b"".join(pieces[i] for i in tok.encode(text).ids) == text.encode("utf-8")


class _OurTokenizer:
    """A stand-in for the peer that tokenizes exactly as ours; subclasses break one thing."""

    def __init__(self):
        from edge.model.tokenizer import load_tokenizer

        self.tok, self.pieces = load_tokenizer(BUNDLED_EE_DIR), tk.our_token_bytes(BUNDLED_EE_DIR)
        self.vocab_size = len(self.pieces)

    def piece(self, i, special=True):
        return self.pieces[i]

    def tokenize(self, text, special=False):
        return self.tok.encode(text).ids


def test_tokenizer_check_passes_for_an_identical_tokenizer():
    assert tk.verify_tokenizer(BUNDLED_EE_DIR, _OurTokenizer(), texts=["a b", "\t\n  x"]) == 2


def test_tokenizer_mismatch_names_the_first_difference():
    class Shifted(_OurTokenizer):
        def tokenize(self, text, special=False):
            ids = super().tokenize(text)
            return ids[:2] + [ids[2] + 1] + ids[3:]

    with pytest.raises(tk.TokenizerMismatch, match="first difference at token 2"):
        tk.verify_tokenizer(BUNDLED_EE_DIR, Shifted(), texts=["def f(x):\n    return x + 1\n"])


def test_vocabulary_mismatch_names_the_token():
    class Cut(_OurTokenizer):
        def piece(self, i, special=True):
            return self.pieces[i][:32]  # what llama-cpp-python's own detokenize does to long pieces

    peer = Cut()
    first_long = next(i for i, p in enumerate(peer.pieces) if len(p) > 32)
    with pytest.raises(tk.TokenizerMismatch, match=f"token {first_long} is"):
        tk.verify_tokenizer(BUNDLED_EE_DIR, peer, texts=[])


def test_converter_refusal_of_a_non_gpt2_tokenizer_is_explained_and_leaves_nothing(tmp_path, monkeypatch, ours):
    """Only a tokenizer checked to be GPT-2 byte-level gets the pre-type fallback; a refusal names why."""
    import subprocess

    import edge.core.device

    model = tmp_path / "model"
    model.mkdir()
    tj = copy.deepcopy(ours)
    _metaspace(tj)
    (model / "tokenizer.json").write_text(json.dumps(tj))
    seen = []

    def fake_run(argv, timeout=600.0):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", f"NotImplementedError: {gg.UNKNOWN_PRE} - update")

    monkeypatch.setattr(gg, "require_available", lambda: None)
    monkeypatch.setattr(edge.core.device, "run_command", fake_run)
    with pytest.raises(SmartExitError, match="not GPT-2 byte-level BPE.*Metaspace"):
        gg.convert_to_gguf(model, tmp_path / "out" / "m.gguf")
    assert "--gpt2-pre-if-unknown" not in seen[0]
    assert list((tmp_path / "out").iterdir()) == []


@needs_llamacpp
def test_a_file_llamacpp_cannot_load_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(SmartExitError, match="cannot load"):
        lp.LlamaCppPeer(bad, threads=1)
    with pytest.raises(SmartExitError, match="does not exist"):
        lp.LlamaCppPeer(tmp_path / "missing.gguf", threads=1)
