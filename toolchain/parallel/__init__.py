"""Engines across GPUs (issue 27): one engine graph per rank, run by one process per rank.

The stage, as planned (the frame is in place; the slices named below fill the rest):
- `mapping.py`: `RankMapping`, the one object that answers every rank question (tp / pp / expert rank, groups,
  previous / next stage, which layers, which experts, how many heads), with TensorRT-LLM's formulas
  (tensorrt_llm/mapping.py). No other code does rank arithmetic.
- `toolchain/engine/collectives.py`: the collective plugin ops (`trtbuild::AllReduce`, `AllGather`, `Send`,
  `Recv`), their attributes, the `Communicator` protocol that runs them, `LocalComm` (world 1) and `ThreadComm`
  (ranks as threads, for fast tests).
- Slice A: per-rank export and build (`ENGINE/rank{r}/model.onnx`, each rank reading only its own shard).
- Slice B: the process model: rank 0 is the caller's process (scheduler, server) and drives a rank-0 facade that
  implements the runtime's `Engine` protocol; ranks 1.. are spawned worker processes (or torchrun's), each with
  its own ONNX Runtime sessions, the collectives run by torch.distributed (gloo on CPU, NCCL on GPUs), and rank 0
  broadcasting each step's batch. Until slice B lands, opening a multi-rank engine is refused with a UserError.
- Slice C: serving, rank faults (a dead or hung rank turns /health red; the server exits 3 within the collective
  timeout + 5 s), Kubernetes LeaderWorkerSet example.
- Slice D: expert parallelism, TensorRT registration of the collectives, bench/parallel.py.
"""
