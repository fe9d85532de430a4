#!/usr/bin/env python3
"""Peer baseline: Hugging Face transformers' greedy generation with the reference pair, target
alone and assisted by the draft (`assistant_model=`), batch 1, on the code prompts of
bench/prompts/code_prompts.json (cut from the corpus's held-out files), 128 new tokens each.

Acceptance is counted from forward passes: a hook on each model's decoder counts target and draft
forwards; every target forward of assisted generation emits the accepted draft tokens plus one
token of its own, so accepted = new tokens - target forwards, and every draft forward proposes one
candidate token.

Usage (on a GPU host, from the repository root):
  PYTHONUNBUFFERED=1 python3 bench/hf_baseline.py --models models \
      --prompts bench/prompts/code_prompts.json --out bench/hf_baseline.json
"""

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback

T0 = time.time()


def log(msg):
    print(f"[baseline {time.time() - T0:6.1f}s] {msg}", flush=True)


class ForwardCounter:
    def __init__(self, model):
        self.n = 0
        inner = getattr(model, "model", model)  # the decoder stack: called once per forward
        self.handle = inner.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_mode(target, draft, prompts, new_tokens, eos_id, pad_id, assisted, deadline,
             assistant_settings=None):
    import torch
    tcount, dcount = ForwardCounter(target), ForwardCounter(draft)
    rows = []
    try:
        if assistant_settings:
            for k, v in assistant_settings.items():
                setattr(draft.generation_config, k, v)
        for p in prompts:
            if time.time() > deadline:
                log("deadline reached: stopping this mode early")
                break
            x = torch.tensor([p["ids"]], device="cuda")
            kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x),
                          max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                          eos_token_id=eos_id)
            if assisted:
                kwargs["assistant_model"] = draft
            tcount.n = dcount.n = 0
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = target.generate(**kwargs)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            new = out[0, x.shape[1]:].tolist()
            rows.append({"id": p["id"], "new_tokens": len(new), "seconds": dt,
                         "tokens_per_s": len(new) / dt, "target_forwards": tcount.n,
                         "draft_forwards": dcount.n, "output": new})
    finally:
        tcount.handle.remove()
        dcount.handle.remove()
    return rows


def summarise(rows, reference=None):
    if not rows:
        return {"prompts": 0}
    tps = [r["tokens_per_s"] for r in rows]
    out = {"prompts": len(rows),
           "median_tokens_per_s": round(statistics.median(tps), 1),
           "aggregate_tokens_per_s": round(sum(r["new_tokens"] for r in rows) /
                                           sum(r["seconds"] for r in rows), 1),
           "median_ms_per_token": round(1000 * statistics.median(
               r["seconds"] / max(1, r["new_tokens"]) for r in rows), 3),
           "new_tokens_total": sum(r["new_tokens"] for r in rows)}
    if any(r["draft_forwards"] for r in rows):
        accepted = sum(r["new_tokens"] - r["target_forwards"] for r in rows)
        drafted = sum(r["draft_forwards"] for r in rows)
        out["target_forwards_total"] = sum(r["target_forwards"] for r in rows)
        out["draft_forwards_total"] = drafted
        out["accepted_draft_tokens"] = accepted
        out["acceptance_rate"] = round(accepted / max(1, drafted), 4)
        out["tokens_per_target_forward"] = round(
            out["new_tokens_total"] / max(1, out["target_forwards_total"]), 3)
        out["median_tokens_per_target_forward"] = round(statistics.median(
            r["new_tokens"] / max(1, r["target_forwards"]) for r in rows), 3)
    out["per_prompt"] = [{k: (round(v, 4) if isinstance(v, float) else v)
                          for k, v in r.items() if k != "output"} for r in rows]
    if reference:
        ref = {r["id"]: r["output"] for r in reference}
        same = [r["output"] == ref.get(r["id"]) for r in rows if r["id"] in ref]
        out["outputs_identical_to_target_only"] = f"{sum(same)}/{len(same)}"
    return out


def brief(summary):
    return {k: v for k, v in summary.items() if k != "per_prompt"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--prompts", default="bench/prompts/code_prompts.json")
    ap.add_argument("--out", default="")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=300,
                    help="stop starting new prompts after this many seconds")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    deadline = T0 + args.budget_s
    prompts = json.load(open(args.prompts))["prompts"]
    result = {"command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(0),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "prompts": len(prompts),
              "prompt_tokens_median": statistics.median(len(p["ids"]) for p in prompts),
              "new_tokens": args.new_tokens, "batch": 1, "runs": {}}
    for dtype_name in [d for d in args.dtypes.split(",") if d]:
        dtype = getattr(torch, dtype_name)
        try:
            target = AutoModelForCausalLM.from_pretrained(f"{args.models}/pycoder-target",
                                                          dtype=dtype).to("cuda").eval()
            draft = AutoModelForCausalLM.from_pretrained(f"{args.models}/pycoder-draft",
                                                         dtype=dtype).to("cuda").eval()
            eos_id = target.generation_config.eos_token_id
            pad_id = target.generation_config.pad_token_id
            if pad_id is None:
                pad_id = eos_id
            defaults = {k: getattr(draft.generation_config, k, None)
                        for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                  "assistant_confidence_threshold")}
            # Warm-up: kernels, allocator, generate's first-call paths.
            run_mode(target, draft, prompts[:2], 16, eos_id, pad_id, False, deadline)
            run_mode(target, draft, prompts[:2], 16, eos_id, pad_id, True, deadline)
            base = run_mode(target, draft, prompts, args.new_tokens, eos_id, pad_id, False,
                            deadline)
            result["runs"][f"{dtype_name}/target_only"] = summarise(base)
            log(f"{dtype_name} target only: {brief(result['runs'][f'{dtype_name}/target_only'])}")
            assisted = run_mode(target, draft, prompts, args.new_tokens, eos_id, pad_id, True,
                                deadline)
            s = summarise(assisted, base)
            s["assistant_settings"] = {k: (v if v is not None else "transformers default")
                                       for k, v in defaults.items()}
            result["runs"][f"{dtype_name}/assisted_default"] = s
            log(f"{dtype_name} assisted (defaults): {brief(s)}")
            if dtype_name == "bfloat16":
                fixed = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                         "assistant_confidence_threshold": 0.0}
                assisted4 = run_mode(target, draft, prompts, args.new_tokens, eos_id, pad_id,
                                     True, deadline, assistant_settings=fixed)
                s = summarise(assisted4, base)
                s["assistant_settings"] = fixed
                result["runs"][f"{dtype_name}/assisted_k4"] = s
                log(f"{dtype_name} assisted (k=4 constant): {brief(s)}")
            del target, draft
            torch.cuda.empty_cache()
        except Exception as e:
            traceback.print_exc()
            result["runs"][f"{dtype_name}/error"] = repr(e)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print("BASELINE_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
