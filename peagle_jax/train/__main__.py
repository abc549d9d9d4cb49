from peagle_jax.train.cli import main

main()
