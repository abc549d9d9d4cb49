"""Train a P-EAGLE (or EAGLE-3) drafter end to end; see train/README.md.

python train/train.py --config train/configs/tiny.yaml --output runs/tiny [section.key=value ...]
"""

from peagle_jax.train.cli import main

if __name__ == "__main__":
    main()
