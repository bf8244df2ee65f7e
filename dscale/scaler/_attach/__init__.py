"""``GradScaler.attach()``: the check folded into DDP's / FSDP2's gradient reduction."""
