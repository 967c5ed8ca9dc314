"""The suite's one tolerance rule: how far two computations of the same value may
differ by rounding alone.

Each floating-point operation rounds its exact result to within a relative unit
roundoff u (2**-24 in float32, 2**-53 in float64). A sum of n terms, added in any
order, lies within n*u times the sum of the terms' sizes of the exact sum (Higham,
Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and section 3.1:
gamma_n = n*u / (1 - n*u), which is n*u to first order). Along a chain of such steps
the bounds add, to first order. So a value that passes through `steps` rounded
operations, none of whose terms is larger than `size`, lies within steps*u*size of
the exact value; two computations of it (other kernels, another order of summation,
another CPU's vector width) lie within twice that of each other.

Each test counts the steps of the computation it checks and says so where it calls
`rounding_tolerance`; no tolerance is fitted to what one CPU's kernels happened to
give. The bound is first order: it holds while steps*u stays far below 1, as it does
for every count in this suite.
"""

import torch


def unit_roundoff(dtype=torch.float32):
    """u: half the gap between 1 and the next number of `dtype`."""
    return torch.finfo(dtype).eps / 2


def rounding_tolerance(steps, size, dtype=torch.float32):
    """How far apart two roundings of one computation may land: twice steps*u*size."""
    return 2 * steps * unit_roundoff(dtype) * float(size)
