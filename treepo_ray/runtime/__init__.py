"""Layer 6: the only package that imports Ray. Thin actor shells over the layers below (engine.py, scheduler.py,
verifier.py, healer.py, learner.py: one module per actor kind; weights.py), the engines' router and pool (router.py,
pool.py), the supervisor that owns every actor's life, failure and deadline (supervisor.py, with liveness.py,
registry.py and chaos.py), the batch builder (batches.py), the evaluator (evaluator.py), the loop (loop.py), and
`treepo-ray train` (train.py, with cluster.py). ARCHITECTURE.md is the map."""
