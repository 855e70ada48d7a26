"""Layer 5: the only package that imports Ray. Thin actor shells over the layers below and the asynchronous
pipeline that wires them: engine.py, pool.py, scheduler.py, verifier.py, healer.py, learner.py (one module per
actor kind), registry.py (membership and fault journal), pipeline.py (the loop), recovery.py (the loop that
survives a lost learner) and train.py (`treepo-ray train`)."""
