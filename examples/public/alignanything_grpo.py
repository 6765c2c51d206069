"""The GRPO trainer of PKU-Alignment's align-anything (PKU-Alignment/align-anything @
3f9decc221be74b2052e712e3a32e155686ec6ec, align_anything/trainers/text_to_text/grpo.py with its defaults from
align_anything/configs/train/text_to_text/grpo.yaml, the engine of trainers/base/rl_trainer.py and
configs/deepspeed/ds_z3_config.json; Apache License 2.0, Copyright 2025 PKU-Alignment Team), run on the harness's
rollouts.
https://github.com/PKU-Alignment/align-anything/blob/3f9decc221be74b2052e712e3a32e155686ec6ec/align_anything/trainers/
text_to_text/grpo.py

Adapted as a user would, with the fewest changes: `train_step` from the rewards on is kept as written (advantages,
log-probs, KL, per-token loss, its completion mask, the token mean), and the engine's optimizer and scheduler as
`_init_train_deepspeed_engine` builds them. Replaced, each line marked `# parity`: generation (the group's
completions from the harness's round, right-padded with the pad id as `generate` pads them), the reward model (the
rollout's weighted reward), DeepSpeed (a one-process engine: ZeRO and bf16 left out, float32; FusedAdam is torch's
AdamW, the same update), the prompt dataloader (the rounds' groups in order, one prompt per step, as
per_device_prompt_batch_size = 1 takes them; its length, the scheduler's horizon, is the spec's data size) and the
logger (parity.log_step). num_generations = GROUP_SIZE.

Written down from the source before any run (what the explanation should find; the test asserts it):
- selection: one prompt group per optimizer step (per_device_prompt_batch_size 1, gradient_accumulation_steps 1):
  step s trains group s % 4 of round s // 4 (parity.trained); TRL has none: the built-in SELECTION;
- rewards: the rollout's weighted sum, as TRL's; advantages: (r - mean) / (Bessel std + 1e-4) per group, as TRL's;
- forward pass: attention_mask = (sequences != pad_token_id), the pad id 0 (<|endoftext|>, not the eos 2 here): a
  SAMPLED token 0 is hidden from every later token (positions still count it: no position_ids are passed) yet stays
  in the loss (the loss mask runs to the first eos). TRL has no setting; the built-in loop has no switch for a mask
  by the pad id (none exists; MASK_TOKEN_ID is a loss mask). Log-probs on the raw logits: TEMPERATURE = 1, alike;
- objective: exp(logp - logp.detach()) * A on the current policy at every step (ratio 1, no clip): with a round
  over 4 steps the built-in loop needs LOGP_OLD = "current" (TRL keeps the round's old log-probs); a k3 KL of
  beta = 0.01 to the initial model inside the loss, without TRL's ratio factor: TRL beta = 0.01,
  use_bias_correction_kl = false;
- weighting: (per_token_loss * mask).sum() / mask.sum() over the step's one group: a token mean over the step,
  TRL's loss_type = "dapo" (one micro-batch: "bnpo" alike);
- optimizer: AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.01 without norms and biases (as transformers'
  Trainer), lr 1e-5, gradient clipping 1.0: TRL learning_rate = 1e-5, adam_beta2 = 0.95, weight_decay = 0.01;
- schedule: transformers' "cosine" with int(768 x 0.03) = 23 warmup steps over a horizon of 768 steps (256 prompts x
  3 epochs): the rate climbs from 0 through all 12 steps (k / 23 x 1e-5 at step k + 1). TRL lr_scheduler_type =
  "cosine", warmup_steps = 23 (over max_steps = 768); the run's 12 steps end inside the warmup;
- logged: `loss` (the step's, the KL included) and `reward` (the group's mean), no learning rate; the adaptation
  adds the pre-clip `grad_norm` the contract's Probe needs (docs/your-loop.md), the engine's own;
- 12 steps cannot show: the cosine's horizon past the warmup (only the warmup's slope acts: 23 and 768 are read as
  one rate per step); the clip (ratio 1); whether a temperature divides (TEMPERATURE = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from harness import loop as parity  # parity: the contract's helpers


@dataclass
class TrainCfgs:
    """grpo.yaml's train_cfgs (and ds_z3_config.json's gradient_clipping) as the trainer reads them."""

    epochs: int = 3
    seed: int = 42
    per_device_prompt_batch_size: int = 1
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    actor_lr: float = 1e-5
    actor_lr_scheduler_type: str = "cosine"
    actor_lr_warmup_ratio: float = 0.03
    actor_weight_decay: float = 0.01
    adam_betas: tuple = (0.9, 0.95)
    update_iters: int = 1
    num_generations: int = 10
    beta: float = 0.01
    gradient_clipping: float = 1.0


def get_optimizer_grouped_parameters(module, weight_decay, no_decay_name_list=(
        "bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")):
    return [
        {"params": [p for n, p in module.named_parameters()
                    if (not any(nd in n for nd in no_decay_name_list) and p.requires_grad)], "weight_decay": weight_decay},
        {"params": [p for n, p in module.named_parameters()
                    if (any(nd in n for nd in no_decay_name_list) and p.requires_grad)], "weight_decay": 0.0},
    ]


class Engine:  # parity: DeepSpeed's engine in one process
    """backward() over the accumulation steps, step() clipping, stepping the optimizer and the scheduler."""  # parity

    def __init__(self, module, optimizer, lr_scheduler, gas: int, clip: float):  # parity
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler  # parity
        self.gas, self.clip = gas, clip  # parity
        self.probe, self.micro, self.steps = parity.Probe(module), 0, 0  # parity: the weights around each step

    def zero_grad(self):  # parity
        self.optimizer.zero_grad()  # parity

    def backward(self, loss):  # parity
        (loss / self.gas).backward()  # parity

    def step(self):  # parity
        self.micro += 1  # parity
        if self.micro % self.gas:  # parity
            return  # parity
        self.steps += 1  # parity
        self.probe.before(self.steps)  # parity: the gradient before clipping
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip).item()  # parity
        self.optimizer.step()  # parity
        self.probe.after(self.steps)  # parity
        self.lr_scheduler.step()  # parity
        self.optimizer.zero_grad()  # parity


class GRPOTrainer:
    def __init__(self, cfgs: TrainCfgs, prompts: int) -> None:
        self.cfgs = cfgs
        self.tokenizer = AutoTokenizer.from_pretrained(parity.init_dir(), padding_side="left")  # parity: PARITY_INIT
        self.actor_model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), dtype=torch.float32)  # parity
        self.actor_reference_model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), dtype=torch.float32)  # parity
        self.actor_reference_model.eval()
        self.beta = cfgs.beta
        self.num_generations = cfgs.num_generations
        total_training_steps = (prompts // cfgs.per_device_prompt_batch_size  # parity: len(prompt_only_dataloader)
                                * cfgs.epochs * cfgs.update_iters * cfgs.per_device_prompt_batch_size
                                // cfgs.per_device_train_batch_size)
        optimizer = torch.optim.AdamW(get_optimizer_grouped_parameters(self.actor_model, cfgs.actor_weight_decay),  # parity
                                      lr=cfgs.actor_lr, betas=cfgs.adam_betas)  # parity: FusedAdam
        lr_scheduler_update_steps = total_training_steps // cfgs.gradient_accumulation_steps
        num_warmup_steps = int(lr_scheduler_update_steps * cfgs.actor_lr_warmup_ratio)
        lr_scheduler = get_scheduler(name=cfgs.actor_lr_scheduler_type, optimizer=optimizer,
                                     num_warmup_steps=num_warmup_steps, num_training_steps=lr_scheduler_update_steps)
        self.actor_model = Engine(self.actor_model, optimizer, lr_scheduler,  # parity
                                  cfgs.gradient_accumulation_steps, cfgs.gradient_clipping)  # parity
        self.actor_model.module.train()

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        logits = outputs.logits
        logits = logits[:, :-1, :]
        logits = logits[:, -logits_to_keep:, :]
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        target_ids = input_ids[:, -logits_to_keep:]
        return log_probs.gather(dim=-1, index=target_ids.unsqueeze(-1)).squeeze(-1)

    def train_step(self, group: dict, step: int) -> dict[str, float]:  # parity: the step's group comes in
        sequences, prompt_length = group["sequences"], group["prompt_length"]  # parity: generate_completions
        rewards = group["rewards"]  # parity: compute_rewards (the reward model)
        B = 1
        G = self.num_generations
        rewards = rewards.view(B, G)
        group_mean = rewards.mean(dim=1, keepdim=True)
        group_std = rewards.std(dim=1, keepdim=True) + 1e-4
        advantages = (rewards - group_mean) / group_std
        advantages = advantages.view(-1, 1)

        attention_mask = (sequences != self.tokenizer.pad_token_id).long()
        logits_to_keep = sequences.size(1) - prompt_length
        per_token_logps = self._get_per_token_logps(self.actor_model.module, sequences, attention_mask, logits_to_keep)
        with torch.no_grad():
            ref_per_token_logps = self._get_per_token_logps(self.actor_reference_model, sequences, attention_mask,
                                                            logits_to_keep)
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1)
        advantages_expanded = advantages.expand(-1, logits_to_keep)
        per_token_loss = torch.exp(per_token_logps - per_token_logps.detach()) * advantages_expanded
        per_token_loss = -(per_token_loss - self.beta * per_token_kl)

        completion_tokens = sequences[:, prompt_length:]
        eos_token_id = self.tokenizer.eos_token_id
        completion_mask = torch.ones_like(completion_tokens)
        for i in range(completion_tokens.size(0)):
            eos_positions = (completion_tokens[i] == eos_token_id).nonzero(as_tuple=False)
            if eos_positions.numel() > 0:
                first_eos = eos_positions[0].item()
                completion_mask[i, first_eos + 1:] = 0
        completion_mask = completion_mask.to(per_token_loss.dtype)
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()

        self.actor_model.zero_grad()
        self.actor_model.backward(loss)
        parity.trained(step, group["rows"])  # parity: one group of a round per step
        parity.tensors(step, rewards=rewards.view(-1), advantages=advantages.view(-1), mask=completion_mask,  # parity
                       logps=per_token_logps.detach(), ref_logps=ref_per_token_logps,  # parity
                       per_token_loss=per_token_loss.detach(), loss=loss.item())  # parity
        self.actor_model.step()
        return {"train/loss": loss.item(), "train/reward": rewards.mean().item()}


def groups_in_order(steps: int, size: int, pad_id: int) -> list[dict]:  # parity: the prompt dataloader
    """The rounds' prompt groups in order, each as `generate` returns it: prompt + completions, right-padded."""  # parity
    out, rnd = [], 0  # parity
    while len(out) < steps:  # parity
        ro = parity.rollout(rnd)  # parity
        weights = ro["reward_weights"]  # parity
        for start in range(0, len(ro["completion_ids"]), size):  # parity
            idx = list(range(start, start + size))  # parity
            seqs = [ro["prompt_ids"][i] + ro["completion_ids"][i] for i in idx]  # parity
            width = max(len(s) for s in seqs)  # parity
            out.append({"sequences": torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs]),  # parity
                        "prompt_length": len(ro["prompt_ids"][start]), "rows": [(rnd, i) for i in idx],  # parity
                        "rewards": torch.tensor([sum(w * ro["rewards"][k][i] for k, w in zip(ro["rewards"], weights))  # parity
                                                 for i in idx])})  # parity
        rnd += 1  # parity
    return out[:steps]  # parity


def main() -> None:
    spec = parity.spec()  # parity
    if not spec:
        raise SystemExit("alignanything_grpo.py trains only on the harness's rollouts; sampling needs align-anything")
    cfgs = TrainCfgs(num_generations=spec["GROUP_SIZE"])  # parity: the rollouts' group size
    torch.manual_seed(parity.seed(cfgs.seed))  # parity: the run's seed (seed_everything)
    trainer = GRPOTrainer(cfgs, prompts=spec["data"]["size"])  # parity: the harness's prompt set
    for step, group in enumerate(groups_in_order(spec["STEPS"], cfgs.num_generations,  # parity
                                                 trainer.tokenizer.pad_token_id), start=1):  # parity
        train_info = trainer.train_step(group, step)
        parity.log_step(step, loss=train_info["train/loss"], reward=train_info["train/reward"],  # parity: the logger
                        grad_norm=trainer.actor_model.grad_norm)  # parity: the pre-clip norm the Probe needs
    parity.save_weights(trainer.actor_model.module)  # parity: the final weights


if __name__ == "__main__":
    main()
