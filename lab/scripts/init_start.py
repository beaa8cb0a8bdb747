"""How good is an untrained drafter? Its first draft step against the target, for each way of starting it.

A short training budget (the side by side with SpecForge: 600 steps of 16 samples) rewards a good start. This
builds the drafter `eyas train` would build for the target and reads, before any training step, its step-0
prediction on prepared samples: top-1 agreement with the target's own argmax, and the soft cross-entropy
against the target's distribution (the training loss of step 0), on the loss-masked (answer) tokens. Starts:

- random: `eyas train`'s default (Normal(0, 0.02) linears; the target's embedding);
- init_head: `--init-head` (lm_head and the final norm from the target's);
- pass_through: init_head, plus fc copying the highest aux state and the layer's output projections at zero (no
  `eyas train` option: built here only). The drafter then reads the target's head at that layer (a logit lens)
  of position t; but step 0 pairs the state of position t with token x_{t+1} and predicts x_{t+2}, so a lens of
  position t answers the wrong question. Measured (SmolLM2, 11 held-out ShareGPT samples, 8,059 answer tokens,
  2026-12-01, CPU): top-1 0.0000 / 0.0000 / 0.0495 and soft CE 10.91 / 33.09 / 16.05 nats for random /
  init_head / pass_through: no start beats random on the loss, so no pass-through option was added to eyas.

The draft vocabulary here is the target's whole vocabulary (no frequency count needed); CPU, fp32.

    PYTHONPATH=src python lab/scripts/init_start.py --data PREPARED [--target default] [--samples 32]

The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="an `eyas prepare` output made with this target's tokenizer")
    ap.add_argument("--target", default="default")
    ap.add_argument("--split", default="train")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="the random start's seed (as `eyas train --seed`)")
    args = ap.parse_args()

    from eyas.data.prepared import PreparedDataset
    from eyas.defaults import resolve_target
    from eyas.drafter.layouts import default_aux_layer_ids
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import forward_capture, load_target

    torch.manual_seed(args.seed)
    target_dir = resolve_target(args.target)
    model = load_target(target_dir)
    hf = model.config
    layers = default_aux_layer_ids(hf.num_hidden_layers)
    split = PreparedDataset(args.data).split(args.split)
    n = min(args.samples, len(split))
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    norm = model.model.norm.weight.detach().float()

    def drafter(start: str) -> Eagle3Drafter:
        cfg = DrafterConfig.from_target_config(hf, draft_vocab_size=hf.vocab_size, aux_layer_ids=layers)
        d = Eagle3Drafter(cfg)
        d.reset_parameters(seed=args.seed)
        d.set_vocab(torch.arange(hf.vocab_size))
        with_head = start in ("init_head", "pass_through")
        d.init_from_target(embed, head if with_head else None, norm if with_head else None)
        if start == "pass_through":  # fc = [0 | 0 | I]: the highest aux slot; attention and MLP add nothing yet
            D = cfg.hidden_size
            with torch.no_grad():
                d.fc.weight.zero_()
                d.fc.weight[:, -D:].copy_(torch.eye(D))
                d.midlayer.self_attn.o_proj.weight.zero_()
                d.midlayer.mlp.down_proj.weight.zero_()
        return d.eval()

    starts = {s: drafter(s) for s in ("random", "init_head", "pass_through")}
    hits = {s: 0 for s in starts}
    ce = {s: 0.0 for s in starts}
    tokens = 0
    t0 = time.time()
    with torch.no_grad():
        for i in range(n):
            s = split[i]
            ids = s.input_ids[None]
            aux, final = forward_capture(model, ids, layer_ids=layers)
            T = ids.shape[1]
            if T < 3:
                continue
            # step 0 at position t: feature_t, token x_{t+1}, position t; teacher p_{t+1}; valid where m_{t+2}
            teacher = F.log_softmax(final[0, 1 : T - 1] @ head.T, dim=-1)  # [T-2, V]
            mask = s.loss_mask[2:].bool()
            if not mask.any():
                continue
            top = teacher.argmax(-1)
            for name, d in starts.items():
                _, logits = d.forward_step(ids[:, 1 : T - 1], d.project_aux(aux[:, : T - 2]), torch.arange(T - 2)[None])
                logq = F.log_softmax(logits[0].float(), dim=-1)
                hits[name] += int((logq.argmax(-1) == top)[mask].sum())
                ce[name] += float(-(teacher.exp() * logq).sum(-1)[mask].sum())
            tokens += int(mask.sum())
    res = {
        "target": str(target_dir),
        "aux_layers": layers,
        "samples": n,
        "supervised_tokens": tokens,
        "seconds": round(time.time() - t0, 1),
        "starts": {
            k: {"top1": round(hits[k] / max(tokens, 1), 4), "soft_ce": round(ce[k] / max(tokens, 1), 4)} for k in starts
        },
    }
    print(f"{'start':14s} {'top-1 vs target':>16s} {'soft CE (nats)':>15s}")
    for k, v in res["starts"].items():
        print(f"{k:14s} {v['top1']:16.4f} {v['soft_ce']:15.4f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
