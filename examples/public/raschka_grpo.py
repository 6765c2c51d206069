"""The GRPO loop of Sebastian Raschka's "Build a Reasoning Model (From Scratch)", chapter 6
(rasbt/reasoning-from-scratch @ f79c9cd0ae7d824aa4e9a9bc2ca4a85167f81958,
ch06/02_rlvr_grpo_scripts_intro/rlvr_grpo_original_no_kl.py, Apache-2.0), run on the harness's rollouts.

A session adapted the book's script to the harness's contract, as a reader of the book would, and wrote down before
any run how it differs from TRL (docs/your-loop.md). That adaptation copied the book's code, imports the book's
package and stays outside this repository; this file restates the same choices in our own code, and trains exactly
as it does (same metrics and tensors at every step, checked side by side on CPU):
- one prompt per optimizer step: step s (from 0) trains group s % n of round s // n, n the round's prompts, its
  GROUP_SIZE completions in the rollout's order (reported with parity.trained);
- rewards: correctness only (the rollout's reward_correct; the book grades a \\boxed{} answer), no format reward;
- advantages: (reward - group mean) / (group std + 1e-4), Bessel-corrected std; a group of equal rewards still steps
  the optimizer (the book's skip_zero_adv is off), so momentum and weight decay move the weights;
- the loss: REINFORCE without a ratio, clip or KL, -(A_i * sum_t logp_it) averaged over the group's sequences, the
  SUM over each completion's tokens (eos included); each sequence its own forward (a batch of one, no padding, no
  attention mask), log-probs from the raw logits in float32 (no temperature);
- the optimizer: torch AdamW with torch's defaults (betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every
  parameter), lr 1e-5 constant (the book's default; the spec's LR is not read), gradient clipping at 1.0;
- what it logs: the loss above, the pre-clip grad norm, the group's mean correctness and the lr; the per-token
  log-probs it saves for the tensor diff come from a second, gradient-free forward of each sequence;
- the device: CUDA (TF32 matmuls), else MPS, else XPU, else the CPU, as the book picks it.
Outside the harness it only says so: sampling needs the book's package (its Qwen3 model, top-p sampler, MATH data
and grader). NO_TENSORS=1 in the environment leaves the tensor save out, as in the adaptation. The lines marked
`# parity` are the contract's.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

from harness import loop as parity  # parity: the contract's helpers

LR = 1e-5
MAX_GRAD_NORM = 1.0
ADV_EPS = 1e-4


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return torch.device("cpu")


def prompt_groups(steps: int, size: int) -> list[dict]:
    """Enough groups for `steps` steps, round after round, each holding its sequences and correctness scores."""
    groups, rnd = [], 0
    while len(groups) < steps:
        ro = parity.rollout(rnd)  # parity: the harness's completions instead of sampling
        for start in range(0, len(ro["completion_ids"]), size):
            idx = range(start, start + size)
            groups.append(dict(
                seqs=[(ro["prompt_ids"][i] + ro["completion_ids"][i], len(ro["prompt_ids"][i])) for i in idx],
                rewards=[ro["rewards"]["reward_correct"][i] for i in idx],
                rows=[(rnd, i) for i in idx],
            ))
        rnd += 1
    return groups


def completion_logps(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs of the tokens after the prompt, from one unpadded forward."""
    logits = model(ids.unsqueeze(0)).logits.squeeze(0).float()
    logps = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[1:].unsqueeze(-1)).squeeze(-1)
    return logps[prompt_len - 1:]


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    return (rewards - rewards.mean()) / (rewards.std() + ADV_EPS)


def save_tensors(step: int, group: dict, adv: torch.Tensor, token_logps: list, loss: float, grad_norm) -> None:
    logps = torch.nn.utils.rnn.pad_sequence(token_logps, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in token_logps], batch_first=True)
    parity.tensors(step, rewards=group["rewards"], advantages=adv, mask=mask, logps=logps,  # parity
                   per_token_loss=-adv[:, None] * logps, loss=loss, grad_norm=grad_norm)  # parity


def train_step(model, opt, probe, step: int, group: dict, device) -> None:
    seqs = [(torch.tensor(ids, device=device), plen) for ids, plen in group["seqs"]]
    adv = group_advantages(torch.tensor(group["rewards"], device=device))
    seq_logps = torch.stack([completion_logps(model, ids, plen).sum() for ids, plen in seqs])
    with torch.no_grad():
        token_logps = [completion_logps(model, ids, plen) for ids, plen in seqs]
    loss = -(adv * seq_logps).mean()
    opt.zero_grad()
    loss.backward()
    parity.trained(step, group["rows"])  # parity: one group of a round per step
    probe.before(step)  # parity: the gradient before clipping
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    if not os.environ.get("NO_TENSORS"):
        save_tensors(step, group, adv, token_logps, loss.item(), grad_norm)
    opt.step()
    probe.after(step)  # parity: the weights after the step
    parity.log_step(step, loss=loss.item(), grad_norm=grad_norm,  # parity
                    reward=torch.tensor(group["rewards"]).mean().item(), learning_rate=opt.param_groups[0]["lr"])


def main() -> None:
    torch.manual_seed(parity.seed(42))  # parity: the run's seed
    device = pick_device()
    spec = parity.spec()  # parity
    if not spec:
        sys.exit("raschka_grpo.py trains only on the harness's rollouts; sampling needs the book's own package")
    groups = prompt_groups(spec["STEPS"], spec["GROUP_SIZE"])  # parity
    model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), dtype=torch.float32).to(device)  # parity
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step
    model.train()
    for step in range(spec["STEPS"]):
        train_step(model, opt, probe, step + 1, groups[step], device)
    parity.save_weights(model)  # parity: the final weights


if __name__ == "__main__":
    main()
