"""A DeepSpeed training script, unchanged except for its import: the bundled example run.

    zerotune run --nproc_per_node 2 examples/train_gpt2.py --deepspeed_config examples/ds_config.json

Trains a small GPT-2 (random init, no download) to continue arithmetic sequences modulo the
vocabulary, a task it learns within a minute on 2 CPU ranks, then saves a checkpoint and
reports held-out next-token accuracy before and after.
"""

import argparse

import torch
import zerotune as deepspeed
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 64, 32


def arithmetic_sequences(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Rows like 5, 8, 11, 14, ... (mod VOCAB): every token after the second is predictable."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    return torch.utils.data.TensorDataset((start + stride * torch.arange(SEQ)) % VOCAB)


def collate(rows):
    ids = torch.stack([row[0] for row in rows])
    return {"input_ids": ids, "labels": ids}


@torch.no_grad()
def accuracy(engine, dataset) -> float:
    engine.eval()
    ids = dataset.tensors[0].to(engine.device)
    logits = engine(input_ids=ids).logits
    correct = (logits[:, 1:-1].argmax(-1) == ids[:, 2:]).float().mean()
    engine.train()
    return correct.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output_dir", default="checkpoints/example")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    train_set, held_out = arithmetic_sequences(4096, seed=1), arithmetic_sequences(256, seed=2)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=train_set, collate_fn=collate)

    before = accuracy(engine, held_out)
    epoch = 0
    while engine.global_steps < scheduler.total_num_steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.global_steps == scheduler.total_num_steps:
                break
        epoch += 1
    after = accuracy(engine, held_out)
    engine.save_checkpoint(args.output_dir)
    if engine.global_rank == 0:
        print(f"held-out next-token accuracy: {before:.3f} before -> {after:.3f} after "
              f"{engine.global_steps} steps on {engine.world_size} ranks; checkpoint in {args.output_dir}")


if __name__ == "__main__":
    main()
