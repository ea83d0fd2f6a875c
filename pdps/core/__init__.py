"""The pure core: task queue, slots, consistency rules. No I/O, no threads, no clock."""
