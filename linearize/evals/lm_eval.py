"""Pass-through to lm-evaluation-harness (optional; imported only when this task runs).

Task spec: ``lm-eval:hellaswag+piqa`` (tasks joined by ``+``; in a comma-separated task list
the names following ``lm-eval:`` that are not linearize tasks are taken as lm-eval tasks too,
so ``lm-eval:hellaswag,piqa`` works). An optional ``@N`` suffix limits every task to N
documents (``lm-eval:hellaswag@200``) for quick checks.

The loaded model is wrapped with lm-eval's ``HFLM`` (no second load). Chat templates are
applied only when ``chat_template=True`` was asked for explicitly, because the published
zero-shot numbers (LoLCATs etc.) are measured without them. Per task, the reported metric is
``acc_norm`` when the task has it, else ``acc``, else its first numeric metric; the headline
score is their mean. Missing package or data end in one line (:class:`EvalError`).
"""

from __future__ import annotations

import importlib

from .common import EvalConfig, EvalError, ModelHandle, Progress

NAME = "lm-eval"
PREFERRED = ("acc_norm", "acc", "exact_match", "f1", "mc2", "word_perplexity")


def parse_args(arg: str | None) -> dict:
    if not arg:
        raise EvalError("bad task 'lm-eval': name the lm-eval tasks, e.g. lm-eval:hellaswag+piqa")
    limit = None
    if "@" in arg:
        arg, _, lim = arg.rpartition("@")
        if not lim.isdigit() or int(lim) <= 0:
            raise EvalError(f"bad lm-eval limit {lim!r}: expected a positive integer, e.g. lm-eval:hellaswag@200")
        limit = int(lim)
    tasks = [t.strip() for t in arg.replace(",", "+").split("+") if t.strip()]
    if not tasks:
        raise EvalError("bad task 'lm-eval': name the lm-eval tasks, e.g. lm-eval:hellaswag+piqa")
    return {"tasks": tasks, "limit": limit}


def count(cfg: EvalConfig, args: dict) -> int:
    return 1


def require_lm_eval():
    try:
        return importlib.import_module("lm_eval"), importlib.import_module("lm_eval.models.huggingface")
    except ImportError:
        raise EvalError("task lm-eval needs lm-evaluation-harness, which is not installed: pip install 'lm-eval[hf]'") from None


def _pick(metrics: dict) -> tuple[str | None, float | None]:
    clean = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}
    for name in PREFERRED:
        if name in clean:
            return name, float(clean[name])
    for k, v in clean.items():
        if k != "alias":
            return k, float(v)
    return None, None


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    lm_eval, hf = require_lm_eval()
    try:
        lm = hf.HFLM(pretrained=handle.model, tokenizer=handle.tokenizer, batch_size=cfg.gen_batch_size or 1)
        if hasattr(lm, "_device"):  # HFLM takes model.device, which is meta when accelerate offloaded the first weights
            lm._device = handle.device
        res = lm_eval.simple_evaluate(model=lm, tasks=list(args["tasks"]), limit=args["limit"],
                                      apply_chat_template=cfg.chat_template is True, log_samples=False)
    except EvalError:
        raise
    except Exception as e:  # noqa: BLE001 - an external harness: report its failure in one line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise EvalError(f"lm-eval failed on {'+'.join(args['tasks'])} ({type(e).__name__}: {first}); "
                        "its datasets must be downloaded beforehand to run offline") from None
    rows = []
    for task, metrics in sorted((res or {}).get("results", {}).items()):
        name, value = _pick(metrics)
        rows.append({"task": NAME, "subtask": task, "metric": name, "score": value,
                     "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}})
    progress.advance()
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    vals = [r["score"] for r in rows if r["score"] is not None]
    return {"metric": "accuracy", "higher_is_better": True,
            "score": round(sum(vals) / len(vals), 6) if vals else None,
            "by_task": {r["subtask"]: r["score"] for r in rows},
            "metric_by_task": {r["subtask"]: r["metric"] for r in rows}}
