"""The laboratory: experiments the product does not run, kept reproducible (probe kernels, probe scripts, their tests
and one page per question). Not part of the `minirt` package; import it from the repository root."""
