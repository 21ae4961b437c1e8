"""What runs inside env worker processes: the worker loops, vector envs, progress marks,
infos. Torch-free (numpy and gymnasium only), so that a worker process starts in a
fraction of a second; nothing here imports the driver's side (``collector/``) or
``inference/``.
"""
