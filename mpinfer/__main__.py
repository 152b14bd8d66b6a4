"""``python -m mpinfer`` (and ``torchrun -m mpinfer train ...``)."""

from mpinfer.cli import main

if __name__ == "__main__":
    main(prog_name="mpinfer")
