"""The driver's chunks-to-batches wing: full chunks in, exact batches out (copied, lent
from the ring, or on-policy rounds), worker restarts, stall watch and episode counts.
"""
