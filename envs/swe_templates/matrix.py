"""Template `matrix`: a tiny dense-matrix library (package `minimat`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""minimat: dense matrices as lists of rows, for small sizes and no dependencies."""

from minimat.linalg import determinant, is_symmetric, minor, power, trace
from minimat.matrix import add, identity, multiply, scale, shape, transpose, zeros

__all__ = [
    "add",
    "determinant",
    "identity",
    "is_symmetric",
    "minor",
    "multiply",
    "power",
    "scale",
    "shape",
    "trace",
    "transpose",
    "zeros",
]
''')

MATRIX = source('''
"""Dense matrices as lists of rows: construction, shape, and element-wise and matrix products."""

from __future__ import annotations

Matrix = list[list[float]]


def shape(m: Matrix) -> tuple[int, int]:
    """(rows, columns). ValueError when the rows differ in length."""
    rows = len(m)
    cols = len(m[0]) if rows else 0
    if any(len(row) != cols for row in m):
        raise ValueError("the rows differ in length")
    return rows, cols


def zeros(rows: int, cols: int) -> Matrix:
    return [[0.0] * cols for _ in range(rows)]


def identity(n: int) -> Matrix:
    """The n x n identity matrix."""
    return [[1.0 if i == j else 0.0 for j in range(n)] for i in range(n)]


def transpose(m: Matrix) -> Matrix:
    """Rows become columns: an r x c matrix gives a c x r one, with result[j][i] == m[i][j]."""
    rows, cols = shape(m)
    return [[m[i][j] for i in range(rows)] for j in range(cols)]


def add(a: Matrix, b: Matrix) -> Matrix:
    """The element-wise sum. ValueError when the shapes differ."""
    if shape(a) != shape(b):
        raise ValueError(f"shapes differ: {shape(a)} and {shape(b)}")
    return [[x + y for x, y in zip(row_a, row_b)] for row_a, row_b in zip(a, b)]


def scale(m: Matrix, factor: float) -> Matrix:
    """Every element multiplied by `factor`."""
    return [[x * factor for x in row] for row in m]


def multiply(a: Matrix, b: Matrix) -> Matrix:
    """The matrix product a @ b. ValueError unless a has as many columns as b has rows."""
    a_rows, a_cols = shape(a)
    b_rows, b_cols = shape(b)
    if a_cols != b_rows:
        raise ValueError(f"cannot multiply {a_rows}x{a_cols} by {b_rows}x{b_cols}")
    return [[sum(a[i][k] * b[k][j] for k in range(a_cols)) for j in range(b_cols)] for i in range(a_rows)]
''')

LINALG = source('''
"""Square-matrix algebra: trace, minors, determinant, powers, symmetry."""

from __future__ import annotations

from minimat.matrix import Matrix, identity, multiply, shape, transpose


def _require_square(m: Matrix) -> int:
    rows, cols = shape(m)
    if rows != cols:
        raise ValueError(f"need a square matrix, got {rows}x{cols}")
    return rows


def trace(m: Matrix) -> float:
    """The sum of the main diagonal."""
    n = _require_square(m)
    return sum(m[i][i] for i in range(n))


def minor(m: Matrix, row: int, col: int) -> Matrix:
    """`m` without the given row and column."""
    return [r[:col] + r[col + 1 :] for i, r in enumerate(m) if i != row]


def determinant(m: Matrix) -> float:
    """The determinant, by Laplace expansion along the first row (fine for small matrices)."""
    n = _require_square(m)
    if n == 0:
        return 1.0
    if n == 1:
        return m[0][0]
    if n == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return sum((-1) ** col * m[0][col] * determinant(minor(m, 0, col)) for col in range(n))


def power(m: Matrix, k: int) -> Matrix:
    """`m` multiplied by itself k times, k >= 0; power(m, 0) is the identity."""
    n = _require_square(m)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    result = identity(n)
    for _ in range(k):
        result = multiply(result, m)
    return result


def is_symmetric(m: Matrix, tolerance: float = 1e-9) -> bool:
    """True when m equals its transpose, element by element within `tolerance`."""
    n = _require_square(m)
    t = transpose(m)
    return all(abs(m[i][j] - t[i][j]) <= tolerance for i in range(n) for j in range(n))
''')

TEST_MATRIX = source("""
import unittest

from minimat.matrix import add, identity, multiply, scale, shape, transpose, zeros


class TestConstruction(unittest.TestCase):
    def test_zeros(self):
        self.assertEqual(zeros(2, 3), [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])

    def test_identity(self):
        self.assertEqual(identity(2), [[1.0, 0.0], [0.0, 1.0]])

    def test_shape(self):
        self.assertEqual(shape([[1, 2, 3], [4, 5, 6]]), (2, 3))

    def test_ragged_raises(self):
        with self.assertRaises(ValueError):
            shape([[1, 2], [3]])


class TestTranspose(unittest.TestCase):
    def test_square(self):
        self.assertEqual(transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])

    def test_rectangular(self):
        self.assertEqual(transpose([[1, 2, 3], [4, 5, 6]]), [[1, 4], [2, 5], [3, 6]])


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add([[1, 2], [3, 4]], [[10, 20], [30, 40]]), [[11, 22], [33, 44]])

    def test_shape_mismatch_raises(self):
        with self.assertRaises(ValueError):
            add([[1, 2], [3, 4]], [[1, 2, 3], [4, 5, 6]])

    def test_scale(self):
        self.assertEqual(scale([[1, 2]], 3), [[3, 6]])


class TestMultiply(unittest.TestCase):
    def test_square(self):
        self.assertEqual(multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]), [[19, 22], [43, 50]])

    def test_rectangular(self):
        self.assertEqual(multiply([[1, 2, 3]], [[1], [2], [3]]), [[14]])

    def test_identity_is_neutral(self):
        m = [[2, 3], [4, 5]]
        self.assertEqual(multiply(m, identity(2)), m)

    def test_mismatch_raises(self):
        with self.assertRaises(ValueError):
            multiply([[1, 2]], [[1, 2]])


if __name__ == "__main__":
    unittest.main()
""")

TEST_LINALG = source("""
import unittest

from minimat.linalg import determinant, is_symmetric, minor, power, trace


class TestTrace(unittest.TestCase):
    def test_trace(self):
        self.assertEqual(trace([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), 15)

    def test_one_by_one(self):
        self.assertEqual(trace([[7]]), 7)

    def test_not_square_raises(self):
        with self.assertRaises(ValueError):
            trace([[1, 2]])


class TestMinor(unittest.TestCase):
    def test_minor(self):
        m = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        self.assertEqual(minor(m, 0, 1), [[4, 6], [7, 9]])


class TestDeterminant(unittest.TestCase):
    def test_two_by_two(self):
        self.assertEqual(determinant([[3, 8], [4, 6]]), -14)

    def test_three_by_three(self):
        self.assertEqual(determinant([[6, 1, 1], [4, -2, 5], [2, 8, 7]]), -306)

    def test_identity(self):
        self.assertEqual(determinant([[1, 0, 0], [0, 1, 0], [0, 0, 1]]), 1)

    def test_singular(self):
        self.assertEqual(determinant([[1, 2, 3], [2, 4, 6], [1, 1, 1]]), 0)


class TestPower(unittest.TestCase):
    def test_zero_is_identity(self):
        self.assertEqual(power([[2, 1], [1, 1]], 0), [[1.0, 0.0], [0.0, 1.0]])

    def test_fibonacci(self):
        self.assertEqual(power([[1, 1], [1, 0]], 5), [[8, 5], [5, 3]])

    def test_first_power(self):
        self.assertEqual(power([[2, 0], [0, 3]], 1), [[2, 0], [0, 3]])

    def test_negative_raises(self):
        with self.assertRaises(ValueError):
            power([[1]], -1)


class TestSymmetric(unittest.TestCase):
    def test_symmetric(self):
        self.assertTrue(is_symmetric([[1, 2], [2, 1]]))

    def test_not_symmetric(self):
        self.assertFalse(is_symmetric([[1, 2], [3, 1]]))


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "transpose-index",
        "minimat/matrix.py",
        "return [[m[i][j] for i in range(rows)] for j in range(cols)]",
        "return [[m[j][i] for i in range(rows)] for j in range(cols)]",
        "transpose() must return the matrix with rows as columns: result[j][i] == m[i][j].",
        (
            "tests.test_linalg.TestSymmetric.test_not_symmetric",
            "tests.test_matrix.TestTranspose.test_rectangular",
            "tests.test_matrix.TestTranspose.test_square",
        ),
    ),
    Mutation(
        "add-shape-check",
        "minimat/matrix.py",
        "if shape(a) != shape(b):",
        "if shape(a)[0] != shape(b)[0]:",
        "add() must raise ValueError when the two matrices differ in shape (rows or columns).",
        ("tests.test_matrix.TestAdd.test_shape_mismatch_raises",),
    ),
    Mutation(
        "multiply-inner",
        "minimat/matrix.py",
        "sum(a[i][k] * b[k][j] for k in range(a_cols))",
        "sum(a[i][k] * b[k][j] for k in range(a_rows))",
        "multiply() gives wrong results for non-square matrices: it must sum over a's columns (b's rows).",
        ("tests.test_matrix.TestMultiply.test_rectangular",),
    ),
    Mutation(
        "trace-last",
        "minimat/linalg.py",
        "return sum(m[i][i] for i in range(n))",
        "return sum(m[i][i] for i in range(n - 1))",
        "trace() must add up the whole main diagonal, the last element included.",
        (
            "tests.test_linalg.TestTrace.test_one_by_one",
            "tests.test_linalg.TestTrace.test_trace",
        ),
    ),
    Mutation(
        "determinant-sign",
        "minimat/linalg.py",
        "return sum((-1) ** col * m[0][col] * determinant(minor(m, 0, col)) for col in range(n))",
        "return sum((-1) ** (col + 1) * m[0][col] * determinant(minor(m, 0, col)) for col in range(n))",
        "determinant() of 3x3 and larger matrices has the wrong sign: the first cofactor is positive.",
        (
            "tests.test_linalg.TestDeterminant.test_identity",
            "tests.test_linalg.TestDeterminant.test_three_by_three",
        ),
    ),
    Mutation(
        "minor-column",
        "minimat/linalg.py",
        "return [r[:col] + r[col + 1 :] for i, r in enumerate(m) if i != row]",
        "return [r[:col] + r[col:] for i, r in enumerate(m) if i != row]",
        "minor() must drop the given column as well as the row.",
        (
            "tests.test_linalg.TestDeterminant.test_identity",
            "tests.test_linalg.TestDeterminant.test_singular",
            "tests.test_linalg.TestDeterminant.test_three_by_three",
            "tests.test_linalg.TestMinor.test_minor",
        ),
    ),
    Mutation(
        "power-count",
        "minimat/linalg.py",
        "for _ in range(k):",
        "for _ in range(k - 1):",
        "power(m, k) must multiply k copies of m: power(m, 1) is m itself.",
        (
            "tests.test_linalg.TestPower.test_fibonacci",
            "tests.test_linalg.TestPower.test_first_power",
        ),
    ),
)

TEMPLATE = Template(
    "matrix",
    "minimat",
    {
        "minimat/__init__.py": INIT,
        "minimat/matrix.py": MATRIX,
        "minimat/linalg.py": LINALG,
        "tests/test_matrix.py": TEST_MATRIX,
        "tests/test_linalg.py": TEST_LINALG,
    },
    MUTATIONS,
)
