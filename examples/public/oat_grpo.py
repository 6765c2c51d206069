"""The GRPO learner of Sea AI Lab's oat (sail-sg/oat @ c1a074c320ff5ca9fe9a4f669bf05208e2f310be, oat/algorithms/ppo.py
PPOLearner.learning_step, oat/learners/base.py, oat/utils/deepspeed.py, oat/args.py; Apache License 2.0), with its
default critic_type "drgrpo" (Dr. GRPO), run as a one-process loop on the harness's rollouts.
https://github.com/sail-sg/oat/blob/c1a074c320ff5ca9fe9a4f669bf05208e2f310be/oat/algorithms/ppo.py

Adapted as a user would, with the fewest changes: `learning_step` is kept as written (its advantages, its loss, its
micro-batches of train_batch_size_per_device = 1 in a numpy permutation, its reference and old log-probs) and the
learner's optimizer and scheduler as base.py builds them, from oat's defaults. Replaced, each line marked `# parity`:
the vLLM actors (the harness's round is a learning round: its completions, the rollout's weighted reward as the
oracle's), DeepSpeed (a one-process engine doing what its engine does here: the loss over the accumulation steps,
a step with gradient clipping at the boundary; FusedAdam, adam_w_mode, is torch's AdamW, bf16 is left out: float32),
the fused lm head (its unfused branch, the same log-probs), wandb (parity.log_step). The vLLM log-probs its truncated
importance weight needs are the learner's own (the harness's sampler here is the policy itself): that weight is 1.
Set to the rollouts: num_samples = GROUP_SIZE, generate_max_length = MAX_TOKENS, temperature = TEMPERATURE,
train_batch_size = the round's completions (one optimizer step per learning round), and the prompt dataset's length
(the scheduler's horizon) = the spec's data size.

Written down from the source before any run (what the explanation should find; the test asserts it):
- rewards: the rollout's weighted sum, put on each completion's last token and summed back (kl_penalty_coef = 0):
  as TRL's;
- advantages: "drgrpo": reward - group mean, no std: TRL scale_rewards = "none";
- mask and forward pass: the completion through its eos (attention mask ones over prompt + completion, right
  padding), logits.float() / temperature: as TRL's;
- objective: PPO's clip at 0.2 on both sides on old log-probs the learner recomputes before the round: ratio 1 with
  one optimizer step per round, so the clip (TRL epsilon_high = 0.2 against the spec's 0.28) cannot act in 12 steps;
  the truncated IS weight (tis_c = 2) is 1 (no separate sampler); a k3 KL to the initial model of weight
  beta = 0.1 (oat's default), aggregated as the policy term, without TRL's ratio factor: TRL beta = 0.1,
  use_bias_correction_kl = false;
- weighting: each sequence's masked SUM over generate_max_length (= MAX_TOKENS), a mean over the micro-batch of 1,
  the engine's 1/16 over the 16 accumulation steps: TRL's loss_type = "dr_grpo";
- optimizer: AdamW betas (0.9, 0.95), eps 1e-8, weight decay l2 = 0 (norms and biases in a group without decay),
  lr 5e-7, gradient clipping at 1.0: TRL learning_rate = 5e-7, adam_beta2 = 0.95;
- schedule: transformers' cosine_with_min_lr with min_lr = 0.1 x lr, warmup ceil(16 x 0.03) = 1 step, over a
  horizon of 16 steps (256 prompts // 16), not the run's 12: TRL lr_scheduler_type = "cosine_with_min_lr",
  lr_scheduler_kwargs = {"min_lr_rate": 0.1}, warmup_steps = 1, over 16 steps (TRL's max_steps = 16; a 12-step
  run of TRL has no other field for the horizon: the built-in loop replays it). The first step's rate is 0;
- logged: `loss` = the LAST micro-batch's pg_loss (one completion's, the KL apart, before the engine's 1/16),
  `learning_rate` = the scheduler's last rate after it stepped (the next step's), `grad_norm` before clipping,
  and oat's own kl3, reg_loss, entropy (the last micro-batch's masked mean), adv_mean;
- 12 steps cannot show: the clip bounds and the IS weight (ratio 1); at lr 5e-7 beta2 0.95, the KL (0.1) and its
  missing ratio factor may act under the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM, get_scheduler

from harness import loop as parity  # parity: the contract's helpers


@dataclass
class PPOArgs:
    """oat's OATArgs and PPOArgs defaults that its GRPO learner reads (oat/args.py, oat/algorithms/ppo.py)."""

    beta: float = 0.1
    critic_type: str = "drgrpo"
    num_ppo_epochs: int = 1
    kl_penalty_coef: float = 0
    reinforce_update: bool = False
    reward_scale: float = 1.0
    tis_c: float | None = 2.0
    cliprange: float = 0.2
    temperature: float = 1.0
    generate_max_length: int = 512
    num_samples: int = 2
    train_batch_size: int = 128
    train_batch_size_per_device: int = 1
    max_norm: float = 1.0
    adam_beta_1: float = 0.9
    adam_beta_2: float = 0.95
    l2: float = 0.0
    learning_rate: float = 5e-7
    lr_scheduler: str = "cosine_with_min_lr"
    lr_warmup_ratio: float = 0.03
    max_epochs: int = 1
    num_prompt_epoch: int = 1
    max_step_adjustment: float = 1
    seed: int = 42


def masked_sum(values, mask, axis=None, constant_normalizer: float = 1.0):
    return (values * mask).sum(axis=axis) / constant_normalizer


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def grouped_parameters(model, weight_decay, no_decay=("bias", "layer_norm.weight", "layernorm.weight", "norm.weight",
                                                      "ln_f.weight")):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]


class Engine:  # parity: DeepSpeed's engine in one process
    """backward() scales the loss by 1 / gradient accumulation steps; step() steps the optimizer (clipping first) and
    the scheduler at each accumulation boundary, as DeepSpeed's engine does."""  # parity

    def __init__(self, model, optimizer, scheduler, gas: int, max_norm: float):  # parity
        self.module, self.optimizer, self.scheduler = model, optimizer, scheduler  # parity
        self.gas, self.max_norm, self.micro_steps, self.global_steps = gas, max_norm, 0, 0  # parity
        self.probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step

    def backward(self, loss):  # parity
        (loss / self.gas).backward()  # parity

    def step(self):  # parity
        self.micro_steps += 1  # parity
        if self.micro_steps % self.gas:  # parity
            return  # parity
        self.global_steps += 1  # parity
        self.probe.before(self.global_steps)  # parity: the gradient before clipping
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_norm)  # parity
        self.optimizer.step()  # parity
        self.probe.after(self.global_steps)  # parity: the weights after the step
        self.scheduler.step()  # parity
        self.optimizer.zero_grad()  # parity


class Learner:
    def __init__(self, args: PPOArgs, prompts_dataset_len: int):
        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), dtype=torch.float32)  # parity: PARITY_INIT
        self.ref_model = None
        if args.beta > 0 or args.kl_penalty_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), dtype=torch.float32)  # parity
            self.ref_model.eval()
        optimizer = torch.optim.AdamW(grouped_parameters(self.model, args.l2), lr=args.learning_rate,  # parity: FusedAdam
                                      betas=(args.adam_beta_1, args.adam_beta_2))
        num_policy_sgd_steps_per_episodes = int(prompts_dataset_len * args.max_epochs // args.train_batch_size)
        self.max_steps = math.ceil(args.num_prompt_epoch * num_policy_sgd_steps_per_episodes)
        max_steps_to_schedule = self.max_steps * args.max_step_adjustment
        scheduler_specific_kwargs = {}
        if args.lr_scheduler in ["cosine_with_min_lr"]:
            scheduler_specific_kwargs["min_lr"] = args.learning_rate * 0.1
        scheduler = get_scheduler(args.lr_scheduler, optimizer,
                                  num_warmup_steps=math.ceil(max_steps_to_schedule * args.lr_warmup_ratio),
                                  num_training_steps=max_steps_to_schedule,
                                  scheduler_specific_kwargs=scheduler_specific_kwargs)
        gas = args.train_batch_size // args.train_batch_size_per_device  # parity: one process
        self.engine = Engine(self.model, optimizer, scheduler, gas, args.max_norm)  # parity
        self.model.train()

    def compute_monte_carlo_advantages(self, rewards, response_masks):
        del response_masks
        rewards = rewards.sum(-1)
        values = rewards.view(-1, self.args.num_samples).mean(dim=1)
        values = values.repeat_interleave(self.args.num_samples, dim=0)
        advantages = rewards - values
        if self.args.critic_type == "grpo":
            std_grouped_rewards = rewards.view(-1, self.args.num_samples).std(dim=1)
            std_grouped_rewards = std_grouped_rewards.repeat_interleave(self.args.num_samples, dim=0)
            advantages = advantages / (std_grouped_rewards + 1e-8)
        return advantages

    def masked_aggregator(self, values, mask, axis=None):
        if self.args.critic_type == "drgrpo":
            return masked_sum(values, mask, axis=axis, constant_normalizer=self.args.generate_max_length)
        return masked_mean(values, mask, axis=axis)

    def get_batch_logps(self, model, input_ids, att_mask, temperature: float = 1.0, compute_entropy: bool = False):
        # parity: the unfused branch (the fused lm head is a GPU kernel; the same log-probs)
        logits = model(input_ids, attention_mask=att_mask)["logits"].float() / temperature
        labels = input_ids[:, 1:].clone()
        logits = logits[:, :-1, :]
        all_logp = logits.log_softmax(-1)
        target_logps = torch.gather(all_logp, dim=2, index=labels.unsqueeze(2)).squeeze(2)
        entropy = None
        if compute_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        return target_logps, entropy

    @staticmethod
    def _trim(att_mask):
        counts = att_mask.sum(0)
        last = torch.where(counts == 0)[0]
        return int(last[0]) if len(last) >= 1 else att_mask.shape[1]

    def learning_step(self, trajectory, step: int):
        args = self.args
        infos = {}
        input_ids, att_mask = trajectory["input_ids"], trajectory["attention_mask"]
        final_rewards = torch.tensor([r[-1] for r in trajectory["rewards"]]).reshape(-1, 1).float() * args.reward_scale
        prompt_id_lens = trajectory["prompt_ids_lens"]
        loss_masks = torch.tensor(trajectory["loss_masks"]).float()
        completion_masks = att_mask.clone().bool()
        for mask, source_len in zip(completion_masks, prompt_id_lens):
            mask[:source_len] = False
        response_masks = completion_masks[:, 1:]
        indices = torch.arange(response_masks.size(1)).expand_as(response_masks)
        eos_indices = torch.where(response_masks, indices, torch.full_like(indices, -1)).max(dim=1).values

        logps = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
        with torch.no_grad():
            for i in range(0, len(input_ids), args.train_batch_size_per_device):
                inds = torch.arange(i, i + args.train_batch_size_per_device)
                last = self._trim(att_mask[inds])
                batch_logps, _ = self.get_batch_logps(self.model, input_ids[inds][:, :last], att_mask[inds][:, :last],
                                                      temperature=args.temperature)
                logps[inds, :last - 1] = batch_logps
        actor_logps = logps.clone()  # parity: the vLLM log-probs are the learner's own (no separate sampler)
        ref_logps = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logps = torch.cat([self.get_batch_logps(self.ref_model, input_ids[i:i + args.train_batch_size_per_device],
                                                            att_mask[i:i + args.train_batch_size_per_device],
                                                            temperature=args.temperature)[0]
                                       for i in range(0, len(input_ids), args.train_batch_size_per_device)])
            rewards = (-args.kl_penalty_coef * (logps - ref_logps) * response_masks).clone()
        else:
            rewards = torch.zeros_like(response_masks).float()
        rewards[torch.arange(len(rewards)), eos_indices] += final_rewards.squeeze()
        advantages = self.compute_monte_carlo_advantages(rewards, response_masks)[:, None]

        stats = {"policy_grad_norm": []}
        saved = {"new": torch.zeros_like(logps), "ptl": torch.zeros_like(logps)}  # parity: rows for parity.tensors
        local_grad_step = 0
        for _ in range(args.num_ppo_epochs):
            batch_inds = np.random.permutation(len(input_ids))
            for b_st in range(0, len(input_ids), args.train_batch_size_per_device):
                local_grad_step += 1
                inds = batch_inds[b_st: b_st + args.train_batch_size_per_device]
                last = self._trim(att_mask[inds])
                mb_advantage, mb_loss_masks = advantages[inds], loss_masks[inds]
                mb_input_ids, mb_att_mask = input_ids[inds][:, :last], att_mask[inds][:, :last]
                mb_response_masks = response_masks[inds][:, :last - 1]
                mb_logps, mb_actor_logps = logps[inds][:, :last - 1], actor_logps[inds][:, :last - 1]
                new_logps, entropy = self.get_batch_logps(self.model, mb_input_ids, mb_att_mask,
                                                          temperature=args.temperature, compute_entropy=True)
                if args.reinforce_update:
                    pg_loss_max = -mb_advantage * new_logps
                else:
                    ratio = torch.exp(new_logps - mb_logps)
                    pg_losses = -mb_advantage * ratio
                    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
                    pg_loss_max = torch.max(pg_losses, pg_losses2)
                    if args.tis_c is not None:
                        pg_loss_max *= torch.exp(mb_logps - mb_actor_logps).clamp(max=args.tis_c)
                pg_loss = self.masked_aggregator(pg_loss_max, mb_response_masks, axis=1)
                pg_loss = (pg_loss * mb_loss_masks).mean()
                infos["pg_loss"] = pg_loss.detach()
                loss = pg_loss
                per_token = pg_loss_max.detach()  # parity
                if args.beta > 0:
                    mb_ref_logps = ref_logps[inds][:, :last - 1]
                    log_ratio = (mb_ref_logps - new_logps).clamp(-40.0, 40.0)
                    kl3 = torch.expm1(log_ratio) - log_ratio
                    infos["kl3"] = (kl3 * mb_response_masks).detach().sum(1).mean()
                    reg_loss = self.masked_aggregator(kl3, mb_response_masks, axis=1)
                    reg_loss = args.beta * (reg_loss * mb_loss_masks).mean()
                    infos["reg_loss"] = reg_loss.detach()
                    loss += reg_loss
                    per_token = per_token + args.beta * kl3.detach()  # parity
                with torch.no_grad():
                    infos["entropy"] = masked_mean(entropy, mb_response_masks)
                saved["new"][inds, :last - 1] = new_logps.detach()  # parity
                saved["ptl"][inds, :last - 1] = per_token  # parity
                self.engine.backward(loss)
                if local_grad_step % self.engine.gas == 0:
                    stats["policy_grad_norm"].append(
                        torch.sqrt(sum(p.grad.norm(2) ** 2 for p in self.model.parameters() if p.grad is not None)))
                    save_tensors(step, trajectory, final_rewards, advantages, response_masks, logps, ref_logps,  # parity
                                 saved, infos["pg_loss"], stats["policy_grad_norm"][-1])  # parity
                self.engine.step()
        infos["policy_grad_norm"] = torch.tensor(stats["policy_grad_norm"]).max()
        infos["adv_mean"] = advantages.mean()
        return infos


def completion_rows(values: torch.Tensor, trajectory: dict) -> list[list[float]]:  # parity: the tensors' rows
    """Each row's values over its completion (positions prompt_len - 1 onwards, its length)."""  # parity
    return [values[i, p - 1:p - 1 + n].tolist()  # parity
            for i, (p, n) in enumerate(zip(trajectory["prompt_ids_lens"], trajectory["response_lens"]))]  # parity


def save_tensors(step, trajectory, final_rewards, advantages, response_masks, logps, ref_logps, saved, loss,  # parity
                 grad_norm) -> None:  # parity
    rows = lambda t: completion_rows(t.float(), trajectory)  # noqa: E731  # parity
    parity.tensors(step, rewards=final_rewards.view(-1), advantages=advantages.view(-1),  # parity
                   mask=rows(response_masks), logps=rows(saved["new"]), old_logps=rows(logps),  # parity
                   ref_logps=rows(ref_logps) if ref_logps is not None else None,  # parity
                   per_token_loss=rows(saved["ptl"]), loss=loss, grad_norm=grad_norm)  # parity


def learning_round(step: int, args: PPOArgs, pad_id: int) -> dict:  # parity: the actors' buffer is the round
    ro = parity.rollout(step)  # parity
    weights = ro["reward_weights"]  # parity
    ids = [p + c for p, c in zip(ro["prompt_ids"], ro["completion_ids"])]  # parity
    width = max(len(x) for x in ids)  # parity: the collate's right padding
    return {"input_ids": torch.tensor([x + [pad_id] * (width - len(x)) for x in ids]),  # parity
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),  # parity
            "rewards": [[sum(w * ro["rewards"][k][i] for k, w in zip(ro["rewards"], weights))]  # parity
                        for i in range(len(ids))],  # parity
            "prompt_ids_lens": [len(p) for p in ro["prompt_ids"]], "loss_masks": [True] * len(ids),  # parity
            "response_lens": [len(c) for c in ro["completion_ids"]]}  # parity


def main() -> None:
    spec = parity.spec()  # parity
    if not spec:
        raise SystemExit("oat_grpo.py trains only on the harness's rollouts; sampling needs oat's vLLM actors")
    args = PPOArgs(num_samples=spec["GROUP_SIZE"], generate_max_length=spec["MAX_TOKENS"],  # parity: the rollouts'
                   temperature=spec["TEMPERATURE"],  # parity
                   train_batch_size=spec["derived"]["sequences_per_step"])  # parity: one step per learning round
    torch.manual_seed(parity.seed(args.seed))  # parity: the run's seed (oat's set_seed)
    np.random.seed(parity.seed(args.seed))  # parity
    learner = Learner(args, prompts_dataset_len=spec["data"]["size"])  # parity: the harness's prompt set
    pad_id = learner.model.config.pad_token_id or 0  # parity
    for step in range(1, spec["STEPS"] + 1):
        infos = learner.learning_step(learning_round(step - 1, args, pad_id), step)  # parity
        parity.log_step(step, loss=infos["pg_loss"], grad_norm=infos["policy_grad_norm"],  # parity: its train/ logs
                        learning_rate=learner.engine.scheduler.get_last_lr()[0], kl3=infos.get("kl3"),  # parity
                        reg_loss=infos.get("reg_loss"), entropy=infos["entropy"], adv_mean=infos["adv_mean"])  # parity
    parity.save_weights(learner.model)  # parity: the final weights


if __name__ == "__main__":
    main()
