"""Train the demo model: a small qwen3moe on the corpus of scripts/build_demo_corpus.py.

Plain PyTorch, bf16 autocast on a CUDA GPU (runs on the CPU too, slowly: the tests use a tiny
shape). The model is exactly the qwen3moe forward that llama.cpp and Strata run: per-head q/k RMS
norms, NeoX RoPE, grouped-query attention, a softmax router whose top k are renormalized, SwiGLU
experts, tied input and output embeddings; the weights keep GGUF's shapes, so the export is a
rename. Training adds the Switch Transformer's load-balancing loss (E * sum_e f_e * p_e).

Three steps, each its own subcommand:

    tokenizer  train the byte-level BPE (qwen2 pre-tokenizer, as llama.cpp's `qwen2` pre-type)
    train      tokenize the corpus (once, cached) and train; resumable: it saves a checkpoint
               every --save-every seconds and when --stop-minutes of this call have passed, and
               the learning-rate schedule runs on training seconds, so a run cut over several
               calls follows the same schedule as one call
    pack       the trained weights as bf16, packed small (see pack_weights) for the trip back

Legend: B sequences, T tokens, D hidden, H heads, Hkv kv heads, hd head dim, E experts, K used,
F expert width, V vocab.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# llama.cpp's `qwen2` pre-tokenizer (strata.tokenizer.bpe.PRE_TOKENIZERS["qwen2"])
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEP = "<|endoftext|>"


@dataclass(frozen=True)
class Shape:
    n_layers: int = 5
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    n_experts: int = 16
    n_experts_used: int = 4
    d_expert: int = 256
    n_vocab: int = 8192
    context: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def n_params(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        experts = 3 * self.n_experts * self.d_model * self.d_expert
        per_layer = attn + experts + self.n_experts * self.d_model + 2 * self.d_model
        return self.n_layers * per_layer + self.n_vocab * self.d_model + self.d_model


SHAPES = {"demo": Shape(), "test": Shape(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                                         head_dim=16, n_experts=4, n_experts_used=2,
                                         d_expert=32, n_vocab=320, context=64)}


# ---- tokenizer --------------------------------------------------------------------------------

def train_tokenizer(corpus: Path, n_vocab: int, out: Path) -> None:
    """A byte-level BPE of n_vocab tokens: the 256 byte symbols, the merges, then SPECIALS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - len(SPECIALS), min_frequency=2,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)

    def docs():
        with open(corpus, encoding="utf-8") as f:
            buf: list[str] = []
            for line in f:
                if line.strip() == SEP:
                    yield "".join(buf)
                    buf = []
                else:
                    buf.append(line)

    tok.train_from_iterator(docs(), trainer)
    tok.add_special_tokens(SPECIALS)
    if tok.get_vocab_size() != n_vocab:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {n_vocab}")
    tok.save(str(out))


def tokenize(corpus: Path, tokenizer: Path, out: Path) -> np.ndarray:
    """The corpus as uint16 token ids, documents joined by <|endoftext|>; cached at `out`."""
    if out.exists():
        return np.fromfile(out, dtype=np.uint16)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    sep = tok.token_to_id(SEP)
    text = corpus.read_text(encoding="utf-8")
    docs = [d.strip("\n") for d in text.split(f"\n{SEP}\n") if d.strip()]
    ids: list[np.ndarray] = []
    for i in range(0, len(docs), 4096):
        for enc in tok.encode_batch(docs[i:i + 4096], add_special_tokens=False):
            ids.append(np.asarray(enc.ids + [sep], dtype=np.uint16))
    arr = np.concatenate(ids)
    tmp = out.with_suffix(".tmp")
    arr.tofile(tmp)
    tmp.replace(out)
    return arr


# ---- the model --------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of pairs (i, i + hd/2). x: [B, heads, T, hd]; cos, sin: [T, hd/2]"""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class DemoMoE(torch.nn.Module):
    """qwen3moe with GGUF's tensor shapes (numpy order): attn_q [H*hd, D], ffn_gate_exps
    [E, F, D], ffn_down_exps [E, D, F], ffn_gate_inp [E, D]."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        P = torch.nn.Parameter
        D, hd = s.d_model, s.head_dim
        self.embed = P(torch.randn(s.n_vocab, D) * 0.02)
        self.out_norm = P(torch.ones(D))
        self.layers = torch.nn.ModuleList()
        for i in range(s.n_layers):
            proj_std = 0.02 / math.sqrt(2 * s.n_layers)  # residual projections (GPT-2's scaling)
            m = torch.nn.Module()
            m.attn_norm, m.ffn_norm = P(torch.ones(D)), P(torch.ones(D))
            m.wq = P(torch.randn(s.n_heads * hd, D) * 0.02)
            m.wk = P(torch.randn(s.n_kv_heads * hd, D) * 0.02)
            m.wv = P(torch.randn(s.n_kv_heads * hd, D) * 0.02)
            m.wo = P(torch.randn(D, s.n_heads * hd) * proj_std)
            m.q_norm, m.k_norm = P(torch.ones(hd)), P(torch.ones(hd))
            m.router = P(torch.randn(s.n_experts, D) * 0.02)
            m.gate = P(torch.randn(s.n_experts, s.d_expert, D) * 0.02)
            m.up = P(torch.randn(s.n_experts, s.d_expert, D) * 0.02)
            m.down = P(torch.randn(s.n_experts, D, s.d_expert) * proj_std)
            self.layers.append(m)
            del i
        inv = 1.0 / s.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.arange(s.context).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.grouped = False  # torch._grouped_mm for the experts (checked by use_grouped_mm)

    def attention(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        B, T, _ = x.shape
        h = rms_norm(x, m.attn_norm, s.rms_eps)
        q = (h @ m.wq.T.to(h.dtype)).view(B, T, s.n_heads, s.head_dim).transpose(1, 2)
        k = (h @ m.wk.T.to(h.dtype)).view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)
        v = (h @ m.wv.T.to(h.dtype)).view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)
        q = rope(rms_norm(q, m.q_norm, s.rms_eps), self.cos[:T], self.sin[:T])
        k = rope(rms_norm(k, m.k_norm, s.rms_eps), self.cos[:T], self.sin[:T])
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, T, -1) @ m.wo.T.to(h.dtype)

    def moe(self, m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (the experts' sum [B, T, D], the load-balancing loss)."""
        s = self.s
        shape = x.shape
        h = rms_norm(x, m.ffn_norm, s.rms_eps).reshape(-1, s.d_model)  # [N, D]
        with torch.autocast(h.device.type, enabled=False):  # the router in float32
            probs = torch.softmax(h.float() @ m.router.float().T, dim=-1)  # [N, E]
        w, ids = torch.topk(probs, s.n_experts_used, dim=-1)  # [N, K]
        w = w / w.sum(-1, keepdim=True)
        E, K = s.n_experts, s.n_experts_used
        frac = torch.bincount(ids.flatten(), minlength=E).float() / ids.numel()
        aux = E * (frac * probs.mean(0)).sum()
        order = ids.flatten().argsort(stable=True)  # pairs sorted by expert
        tok = order // K
        xs = h[tok]  # [N*K, D]
        counts = torch.bincount(ids.flatten(), minlength=E)
        dt = h.dtype
        if self.grouped:
            offs = counts.cumsum(0).to(torch.int32)
            g = torch._grouped_mm(xs, m.gate.to(dt).transpose(1, 2), offs=offs)
            u = torch._grouped_mm(xs, m.up.to(dt).transpose(1, 2), offs=offs)
            y = torch._grouped_mm(F.silu(g) * u, m.down.to(dt).transpose(1, 2), offs=offs)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                xe = xs[start:start + n]
                a = F.silu(xe @ m.gate[e].T.to(dt)) * (xe @ m.up[e].T.to(dt))
                parts.append(a @ m.down[e].T.to(dt))
                start += n
            y = torch.cat(parts)
        y = y * w.flatten()[order, None].to(y.dtype)
        out = torch.zeros_like(h).index_add_(0, tok, y)
        return out.view(shape), aux

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (logits [B, T, V] float32, mean load-balancing loss)."""
        x = self.embed[tokens]
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        aux = x.new_zeros((), dtype=torch.float32)
        for m in self.layers:
            x = x + self.attention(m, x)
            y, a = self.moe(m, x)
            x, aux = x + y, aux + a
        x = rms_norm(x, self.out_norm, self.s.rms_eps)
        return (x @ self.embed.T.to(x.dtype)).float(), aux / len(self.layers)

    def gguf_params(self) -> dict[str, torch.nn.Parameter]:
        """Every weight under its GGUF name (tied output: no output.weight)."""
        out = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm}
        names = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "wq": "attn_q",
                 "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "q_norm": "attn_q_norm",
                 "k_norm": "attn_k_norm", "router": "ffn_gate_inp", "gate": "ffn_gate_exps",
                 "up": "ffn_up_exps", "down": "ffn_down_exps"}
        for i, m in enumerate(self.layers):
            for attr, name in names.items():
                out[f"blk.{i}.{name}.weight"] = getattr(m, attr)
        return out

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.gguf_params().items()}

    @torch.no_grad()
    def load_gguf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, p in self.gguf_params().items():
            p.copy_(tensors[name].view(p.shape))


def use_grouped_mm(model: DemoMoE, dev: torch.device) -> bool:
    """Whether torch._grouped_mm runs here and gives the per-expert loop's outputs and gradients
    (bf16 on Hopper); the loop is the fallback."""
    if dev.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    s = model.s
    x = torch.randn(2, 64, s.d_model, device=dev, dtype=torch.bfloat16, requires_grad=True)
    res = []
    try:
        for grouped in (False, True):
            model.grouped = grouped
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, _ = model.moe(model.layers[0], x)
            (g,) = torch.autograd.grad(y.float().square().sum(), x)
            res.append((y.float(), g))
    except Exception as e:  # noqa: BLE001 (any failure: the loop)
        print(f"grouped_mm: not used ({type(e).__name__}: {e})", flush=True)
        model.grouped = False
        return False
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(res[1], res[0], strict=True))
    model.grouped = err < 2e-2
    print(f"grouped_mm: rel diff to the loop {err:.2e}, used: {model.grouped}", flush=True)
    return model.grouped


# ---- training ---------------------------------------------------------------------------------

def lr_at(t: float, budget: float, peak: float, warmup: float = 0.02) -> float:
    """Linear warm-up over the first `warmup` of the training seconds, then cosine to 10%."""
    f = t / budget
    if f < warmup:
        return peak * f / warmup
    f = min(1.0, (f - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * f)))


def batches(ids: np.ndarray, B: int, T: int, rng: np.random.Generator):
    starts = rng.integers(0, len(ids) - T - 1, size=B)
    x = np.stack([ids[s:s + T + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x)


@torch.no_grad()
def evaluate(model: DemoMoE, ids: np.ndarray, B: int, T: int, dev: torch.device,
             n_batches: int) -> float:
    """Mean next-token loss over fixed windows of the held-out tokens."""
    model.eval()
    n = (len(ids) - 1) // T
    starts = np.linspace(0, (n - 1) * T, num=min(n, B * n_batches), dtype=np.int64)
    total, count = 0.0, 0
    for i in range(0, len(starts), B):
        x = torch.from_numpy(np.stack([ids[s:s + T + 1] for s in starts[i:i + B]])
                             .astype(np.int64)).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits, _ = model(x[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def train(a: argparse.Namespace) -> int:
    dev = torch.device(a.device if a.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    s = SHAPES[a.shape]
    a.out.mkdir(parents=True, exist_ok=True)
    t_tok = time.time()
    train_ids = tokenize(a.corpus / "train.txt", a.tokenizer, a.out / "train.u16")
    held_ids = tokenize(a.corpus / "heldout.txt", a.tokenizer, a.out / "heldout.u16")
    print(f"tokens: {len(train_ids):,} train, {len(held_ids):,} held out "
          f"({time.time() - t_tok:.0f} s)", flush=True)
    torch.manual_seed(a.seed)
    model = DemoMoE(s).to(dev)
    print(f"model: {s.n_params() / 1e6:.1f}M parameters ({asdict(s)})", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": rest, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    ckpt = a.out / "checkpoint.pt"
    state = {"step": 0, "train_s": 0.0, "tokens": 0, "rng": a.seed}
    log_path = a.out / "log.jsonl"
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}, {state['train_s']:.0f} s trained", flush=True)
    use_grouped_mm(model, dev)
    rng = np.random.default_rng(state["rng"] + state["step"])
    budget = a.budget_minutes * 60
    stop_at = time.time() + a.stop_minutes * 60
    last_save = time.time()

    best, best_loss, export = None, float("inf"), None

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "shape": asdict(s), "export": export}, tmp)
        tmp.replace(ckpt)

    with open(log_path, "a") as log:
        while state["train_s"] < budget and time.time() < stop_at:
            t0 = time.time()
            lr = lr_at(state["train_s"], budget, a.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            x = batches(train_ids, a.batch, s.context, rng).to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits, aux = model(x[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            (loss + a.aux * aux).backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            state["tokens"] += x[:, 1:].numel()
            if state["step"] % a.log_every == 0 or state["step"] == 1:
                loss_v, aux_v, gn = loss.item(), aux.item(), gnorm.item()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                state["train_s"] += time.time() - t0
                rec = {"step": state["step"], "tokens": state["tokens"],
                       "train_s": round(state["train_s"], 2), "lr": lr, "loss": loss_v,
                       "aux": aux_v, "grad_norm": gn}
                if state["step"] % (a.log_every * a.eval_every) == 0:
                    rec["heldout_loss"] = evaluate(model, held_ids, a.batch, s.context, dev, 4)
                    if rec["heldout_loss"] < best_loss:  # (kept in case training overfits)
                        best_loss = rec["heldout_loss"]
                        best = {k: v.detach().to("cpu", copy=True)
                                for k, v in model.state_dict().items()}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(json.dumps(rec), flush=True)
            else:
                state["train_s"] += time.time() - t0
            if time.time() - last_save > a.save_every:
                save()
                last_save = time.time()
        final = evaluate(model, held_ids, a.batch, s.context, dev, 32)
        rec = {"step": state["step"], "tokens": state["tokens"], "train_s": state["train_s"],
               "heldout_loss": final, "heldout_ppl": math.exp(final), "final_eval": True}
        if best is not None:  # the best snapshot of this call, on the same windows
            last = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(best)
            rec["best_heldout_loss"] = evaluate(model, held_ids, a.batch, s.context, dev, 32)
            model.load_state_dict(last)
            if rec["best_heldout_loss"] < final:
                export = best
        log.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    save()
    return 0


# ---- the trip back ----------------------------------------------------------------------------

def pack_weights(tensors: dict[str, torch.Tensor], out: Path, part_bytes: int) -> list[Path]:
    """The weights as bf16, split into high and low bytes: the high bytes (sign, exponent, top
    mantissa bit) compress to about 40% with lzma, the low bytes not at all, so they stay raw.
    Writes out/weights.json (names, shapes, offsets) and out/weights.partN (the blob in pieces of
    at most part_bytes). unpack_weights reverses it exactly."""
    names = sorted(tensors)
    arrays = [tensors[n].to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
              .view(np.uint16).ravel() for n in names]
    flat = np.concatenate(arrays)
    hi = lzma.compress((flat >> 8).astype(np.uint8).tobytes(), preset=3)
    lo = (flat & 0xFF).astype(np.uint8).tobytes()
    blob = hi + lo
    meta = {"names": names, "shapes": [list(tensors[n].shape) for n in names],
            "count": int(flat.size), "hi_bytes": len(hi)}
    (out / "weights.json").write_text(json.dumps(meta))
    parts = []
    for i in range(0, len(blob), part_bytes):
        p = out / f"weights.part{i // part_bytes}"
        p.write_bytes(blob[i:i + part_bytes])
        parts.append(p)
    return parts


def unpack_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors pack_weights wrote into `folder`, as float32."""
    meta = json.loads((folder / "weights.json").read_text())
    parts = sorted(folder.glob("weights.part*"), key=lambda p: int(p.name[12:]))
    blob = b"".join(p.read_bytes() for p in parts)
    hi = np.frombuffer(lzma.decompress(blob[: meta["hi_bytes"]]), dtype=np.uint8)
    lo = np.frombuffer(blob[meta["hi_bytes"]:], dtype=np.uint8)
    if hi.size != meta["count"] or lo.size != meta["count"]:
        raise ValueError(f"{folder}: the packed weights are incomplete")
    bits = (hi.astype(np.uint32) << 24) | (lo.astype(np.uint32) << 16)
    flat = torch.from_numpy(bits.view(np.float32).copy())
    out, start = {}, 0
    for name, shape in zip(meta["names"], meta["shapes"], strict=True):
        n = int(np.prod(shape))
        out[name] = flat[start:start + n].view(shape)
        start += n
    return out


def pack(a: argparse.Namespace) -> int:
    saved = torch.load(a.out / "checkpoint.pt", map_location="cpu", weights_only=False)
    model = DemoMoE(Shape(**saved["shape"]))
    # the last weights, or an earlier snapshot that scored better on the held-out text
    model.load_state_dict(saved.get("export") or saved["model"])
    a.dest.mkdir(parents=True, exist_ok=True)
    parts = pack_weights(model.gguf_tensors(), a.dest, a.part_bytes)
    (a.dest / "shape.json").write_text(json.dumps(saved["shape"]))
    print(f"packed {sum(p.stat().st_size for p in parts) / 1e6:.1f} MB in {len(parts)} part(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--corpus", type=Path, required=True, help="train.txt of the corpus")
    t.add_argument("--vocab", type=int, default=Shape().n_vocab)
    t.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("train")
    r.add_argument("--corpus", type=Path, required=True, help="folder with train/heldout.txt")
    r.add_argument("--tokenizer", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True, help="checkpoint, tokens and log")
    r.add_argument("--shape", choices=SHAPES, default="demo")
    r.add_argument("--device", default="auto")
    r.add_argument("--batch", type=int, default=64, help="sequences a step")
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--wd", type=float, default=0.1)
    r.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    r.add_argument("--budget-minutes", type=float, default=15.0,
                   help="training time of the whole run (the schedule's length)")
    r.add_argument("--stop-minutes", type=float, default=1e9, help="stop this call after")
    r.add_argument("--save-every", type=float, default=120.0, help="seconds")
    r.add_argument("--log-every", type=int, default=20)
    r.add_argument("--eval-every", type=int, default=10, help="in log lines")
    r.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True, help="the train run's folder")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--part-bytes", type=int, default=15 << 20)
    a = ap.parse_args(argv)
    if a.cmd == "tokenizer":
        train_tokenizer(a.corpus, a.vocab, a.out)
        return 0
    return train(a) if a.cmd == "train" else pack(a)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
