"""The ``linearize`` model class for lm-eval: a linearize checkpoint or a teacher behind lm-eval's LM API.

``import linearize`` registers it with lm-eval (when lm-eval is installed) as a lazy entry that
points here, so this module, and lm-eval's own heavy ones, load only when an evaluation asks for
``model="linearize"``::

    lm_eval.simple_evaluate(model="linearize", model_args="path=runs/lizard,batch_size=8", tasks=[...])

Model arguments: ``path`` (a checkpoint directory, a bundled teacher name such as
``smollm2-135m``, or a Hugging Face model directory; ``pretrained`` is accepted as a synonym),
``device`` (default ``cuda`` when available, else ``cpu``), ``dtype`` (``auto``: bf16 on CUDA,
fp32 on CPU; or ``float32`` / ``bfloat16`` / ``float16``), ``batch_size`` (an integer, or
``auto``: 16 on CUDA, 4 on CPU), ``max_length`` (tokens of context; default the teacher's trained
context), ``max_gen_toks`` (default 256), ``add_bos_token`` (default false, as lm-eval's ``hf``).

How each request type is scored:

- ``loglikelihood``: context and continuation tokenised as lm-eval's ``TemplateLM`` does (the
  continuation's tokens are those of context+continuation after the context's). Requests with
  the same input tokens (MMLU's four one-letter answers) share one row; rows are sorted by
  length, batched with right padding and read from their own logits, only at the scored
  positions (right padding never reaches a real token of a causal model, so batching does not
  change a score); inputs longer than ``max_length`` keep their last ``max_length`` tokens.
- ``loglikelihood_rolling``: a softmax model reads the text in lm-eval's disjoint rolling windows
  of ``max_length`` tokens; a linearized model reads it in one pass, in pieces that carry its
  state, so every token is conditioned on everything before it.
- ``generate_until``: greedy (unless the task asks ``do_sample``), one request at a time, with
  ``model.generate`` stopping on the task's stop strings and EOS; the text is cut at the first stop.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM

from ..models.loading import context_length, is_linearized, load_model, model_label

log = logging.getLogger(__name__)

MODEL_NAME = "linearize"
CLASS_PATH = "linearize.eval.harness:LinearizeLM"
DEFAULT_MAX_LENGTH = 2048
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_IGNORED_ARGS = {"trust_remote_code", "max_batch_size"}  # lm-eval may pass these; nothing to do with them


def register() -> None:
    """Register ``linearize`` with lm-eval, lazily where lm-eval's registry allows it (0.4.13 does).

    lm-eval fills its model registry with its own names only when it is empty at first lookup, so
    those are registered first, or ``hf`` and the rest would vanish once ``linearize`` is in."""
    from lm_eval.api import registry

    reg = getattr(registry, "model_registry", None)
    if reg is not None and hasattr(reg, "register") and hasattr(reg, "keys"):
        import lm_eval.models  # noqa: F401  (cheap: lazy entries only)

        if MODEL_NAME not in reg:
            reg.register(MODEL_NAME, target=CLASS_PATH)
    else:  # an older lm-eval: a plain dict, no lazy entries
        registry.register_model(MODEL_NAME)(LinearizeLM)


def _as_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def _positive_int(name: str, value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1 or isinstance(value, bool) or (isinstance(value, float) and n != value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


class LinearizeLM(TemplateLM):
    """lm-eval's LM API over ``linearize.models.loading.load_model``."""

    def __init__(self, path: str | None = None, device: str | None = "auto", dtype: str | torch.dtype | None = "auto",
                 batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | str = False, pretrained: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - _IGNORED_ARGS)
        if unknown:
            raise TypeError(f"unknown model argument(s) for model=linearize: {', '.join(unknown)}; "
                            "allowed: path, device, dtype, batch_size, max_length, max_gen_toks, add_bos_token")
        if path is not None and pretrained is not None and path != pretrained:
            raise ValueError(f"give path or pretrained, not both (got {path!r} and {pretrained!r})")
        path = path if path is not None else pretrained
        if not path:
            raise ValueError("model=linearize needs path=DIR (a checkpoint directory) or a teacher name, "
                             "e.g. model_args='path=smollm2-135m'")
        self.path = str(path)
        if device in (None, "", "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self._device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
        if self._device.type == "cuda" and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 unless told otherwise; its hf model falls back too
            log.warning("model=linearize: %s asked for but CUDA is not available; using cpu", device)
            self._device = torch.device("cpu")
        if dtype in (None, "", "auto"):
            dtype = torch.bfloat16 if self._device.type == "cuda" else None
        elif isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}")
            dtype = _DTYPES[dtype]
        bs = str(batch_size)
        if bs.startswith("auto"):
            batch_size = 16 if self._device.type == "cuda" else 4
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.add_bos_token = _as_bool(add_bos_token)

        model, tokenizer = load_model(self.path, device=self._device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {self.path} has no tokenizer files; lm-eval needs one")
        if model.get_output_embeddings() is None:
            raise ValueError(f"model {self.path} is not a causal language model (no output head); "
                             "lm-eval's tasks need next-token log-probabilities")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.linearized = is_linearized(model)
        self._max_length = _positive_int("max_length", max_length) if max_length is not None else (
            context_length(model) or DEFAULT_MAX_LENGTH)
        if self.eot_token_id is None:
            raise ValueError(f"the tokenizer of {self.path} has no EOS token; lm-eval needs one")
        self.batch_sizes = {}  # lm-eval reports these when present
        self._logits_to_keep = True  # computed only where scored (falls back to all positions if unsupported)
        log.info("model=linearize: %s (%s) on %s, %s, batch %d, max_length %d", self.path,
                 "linearized" if self.linearized else "softmax", self._device, next(model.parameters()).dtype,
                 self.batch_size, self._max_length)

    # ------------------------------------------------------------------ what lm-eval asks about

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and the first rolling window) is conditioned on: BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.path.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_path": self.path, "model_label": model_label(self.path), "linearized": self.linearized,
                "model_dtype": str(next(self.model.parameters()).dtype), "max_length": self._max_length}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=False)
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        bos = self.tokenizer.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def _forward_logits(self, rows: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Logits (B, len(positions), V) at ``positions`` of the right-padded rows (a row's positions
        past its own length are padding). Only those positions go through the output head."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(self._device)
        keep = torch.tensor(positions, dtype=torch.long, device=self._device)
        # No attention mask: with right padding every real token sees only real tokens before it.
        if self._logits_to_keep:
            try:
                logits = self.model(ids, use_cache=False, logits_to_keep=keep).logits
                if logits.shape[1] == len(positions):
                    return logits
            except TypeError:  # an architecture whose forward has no logits_to_keep
                pass
            self._logits_to_keep = False
        return self.model(ids, use_cache=False).logits[:, keep]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation) or None, context_ids, continuation_ids)``."""
        from tqdm.auto import tqdm

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        targets: dict[int, list[int]] = {}
        by_input: dict[tuple[int, ...], list[int]] = {}  # requests with the same input share one row
        for i, (_, ctx, cont) in enumerate(requests):
            whole = (list(ctx) + list(cont))[-(self._max_length + 1):]
            n = min(len(cont), len(whole) - 1)
            if n <= 0:
                results[i] = (0.0, True)
                continue
            targets[i] = whole[-n:]
            by_input.setdefault(tuple(whole[:-1]), []).append(i)
        inputs = sorted(by_input, key=lambda k: (-len(k), by_input[k][0]))  # longest first: an OOM shows at once
        with tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm, leave=False) as bar:
            bar.update(len(requests) - len(targets))
            for start in range(0, len(inputs), self.batch_size):
                batch = inputs[start:start + self.batch_size]
                # position p predicts token p + 1: a continuation is read at the input's last len(target) positions
                positions = sorted({p for inp in batch for i in by_input[inp]
                                    for p in range(len(inp) - len(targets[i]), len(inp))})
                column = {p: c for c, p in enumerate(positions)}
                logits = self._forward_logits([list(inp) for inp in batch], positions)
                done = 0
                for row, inp in enumerate(batch):
                    for i in by_input[inp]:
                        target = targets[i]
                        cols = [column[p] for p in range(len(inp) - len(target), len(inp))]
                        logp = F.log_softmax(logits[row, cols].float(), dim=-1)
                        t = torch.tensor(target, device=logp.device)
                        ll = logp.gather(-1, t[:, None]).sum().item()
                        greedy = bool((logp.argmax(-1) == t).all())
                        results[i] = (ll, greedy)
                        key = requests[i][0]
                        if key is not None:
                            self.cache_hook.add_partial("loglikelihood", key, (ll, greedy))
                        done += 1
                bar.update(done)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _stream_logprob(self, ids: list[int], piece: int) -> float:
        """Sum of log p(ids[t] | ids[:t]) for t >= 1 in one pass of a stateful model, carrying its cache."""
        cache, total, prev_last = None, 0.0, None
        x = torch.tensor(ids, dtype=torch.long, device=self._device)[None]
        for start in range(0, x.shape[1], piece):
            chunk = x[:, start:start + piece]
            out = self.model(chunk, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0].float()
            if prev_last is not None:
                logits = torch.cat([prev_last, logits])
                targets = chunk[0]
            else:
                targets = chunk[0, 1:]
            logp = F.log_softmax(logits[:targets.shape[0]], dim=-1)
            total += logp.gather(-1, targets[:, None]).sum().item()
            prev_last = out.logits[0, -1:].float()
        return total

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        from tqdm.auto import tqdm

        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm, leave=False):
            (string,) = req.args
            tokens = self.tok_encode(string, add_special_tokens=False)
            if not tokens:
                ll = 0.0
            elif self.linearized:
                # the state carries everything before a piece, so the piece size only bounds memory
                ll = self._stream_logprob([self.prefix_token_id, *tokens], piece=min(self._max_length, 2048))
            else:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self._max_length, context_len=1)]
                scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
                ll = sum(s for s, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), ll)
            out.append(ll)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm, leave=False):
            context, gen_kwargs = req.args
            kwargs = copy.deepcopy(gen_kwargs) if isinstance(gen_kwargs, dict) else {}
            until = kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            eos = self.tokenizer.decode([self.eot_token_id])
            stops = [s for s in until if s]
            max_new = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = _as_bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sampling = {}
            if do_sample and temperature > 0:
                sampling = {"do_sample": True, "temperature": temperature}
                for key in ("top_p", "top_k"):
                    if key in kwargs:
                        sampling[key] = kwargs.pop(key)
            else:
                sampling = {"do_sample": False}
            if kwargs:
                log.warning("model=linearize ignores generation argument(s) %s", ", ".join(sorted(kwargs)))
            ids = self.tok_encode(context)
            ids = ids[-max(1, self._max_length - max_new):] if ids else [self.prefix_token_id]
            x = torch.tensor(ids, dtype=torch.long, device=self._device)[None]
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            extra = {"stop_strings": stops, "tokenizer": self.tokenizer} if stops else {}
            gen = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                      pad_token_id=pad, eos_token_id=self.eot_token_id, **sampling, **extra)
            text = self.tok_decode(gen[0, x.shape[1]:].tolist())
            for stop in [*stops, eos]:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


register()
