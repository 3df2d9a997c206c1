//! Exact evaluation of an arithmetic expression with Python's operators, precedence and integer
//! semantics, by recursive descent over the tokens. Only arithmetic exists in the grammar, so no
//! input can do anything but compute; and the input, the nesting and every intermediate result are
//! bounded, so no input can make the evaluation hang or exhaust memory.
//!
//! ```text
//! expression := term (("+" | "-") term)*
//! term       := factor (("*" | "/" | "//" | "%") factor)*
//! factor     := ("+" | "-") factor | power
//! power      := primary ("**" factor)?          // right-associative; -2**2 is -(2**2)
//! primary    := number | "(" expression ")"
//! ```

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::{One, Signed, ToPrimitive, Zero};

/// The longest expression accepted, in characters.
pub(crate) const MAX_CHARS: usize = 1000;
/// The most decimal digits a result's numerator or denominator may have.
const MAX_DIGITS: u32 = 10_000;
/// [`MAX_DIGITS`] in bits: every number below `2^33219` has at most 10 000 digits. Checking bits
/// is free; counting digits is not.
const MAX_BITS: u64 = 33_219;
/// How deep parentheses, signs and powers may nest; keeps the recursion's stack use small.
const MAX_DEPTH: usize = 100;

/// Why an expression has no value. The messages are shown to the model.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EvalError {
    #[error("the expression is empty")]
    Empty,
    #[error("the expression is {0} characters long; the limit is {max}", max = MAX_CHARS)]
    TooLong(usize),
    #[error("syntax error at column {column}: {message}")]
    Syntax { column: usize, message: String },
    #[error("parentheses, signs and powers nest more than {max} deep", max = MAX_DEPTH)]
    TooDeep,
    #[error("division by zero at column {0}")]
    DivisionByZero(usize),
    #[error("the exponent of the ** at column {0} is not a whole number, so the power is not exact")]
    FractionalExponent(usize),
    #[error("the number at column {0} is too large: the limit is {max} digits", max = MAX_DIGITS)]
    TooLarge(usize),
}

/// The exact value of `text`.
pub(crate) fn evaluate(text: &str) -> Result<BigRational, EvalError> {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() > MAX_CHARS {
        return Err(EvalError::TooLong(chars.len()));
    }
    let tokens = lex(&chars)?;
    if tokens.is_empty() {
        return Err(EvalError::Empty);
    }
    let mut parser = Parser {
        tokens: tokens.into_iter().peekable(),
        end_column: chars.len() + 1,
        depth: 0,
    };
    let value = parser.expression()?;
    match parser.tokens.peek() {
        None => Ok(value),
        Some((Token::Close, column)) => Err(syntax(*column, "this ')' closes no '('")),
        Some((token, column)) => Err(syntax(
            *column,
            format!("expected an operator but found {}", token.describe()),
        )),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    FloorDiv,
    Mod,
    Pow,
}

enum Token {
    Number(BigRational),
    Op(Op),
    Open,
    Close,
}

impl Token {
    fn describe(&self) -> String {
        let symbol = match self {
            Token::Number(_) => return "a number".to_string(),
            Token::Op(Op::Add) => "+",
            Token::Op(Op::Sub) => "-",
            Token::Op(Op::Mul) => "*",
            Token::Op(Op::Div) => "/",
            Token::Op(Op::FloorDiv) => "//",
            Token::Op(Op::Mod) => "%",
            Token::Op(Op::Pow) => "**",
            Token::Open => "(",
            Token::Close => ")",
        };
        format!("'{symbol}'")
    }
}

fn syntax(column: usize, message: impl Into<String>) -> EvalError {
    EvalError::Syntax {
        column,
        message: message.into(),
    }
}

/// The tokens of `chars`, each with its 1-based column.
fn lex(chars: &[char]) -> Result<Vec<(Token, usize)>, EvalError> {
    let mut tokens = Vec::new();
    let mut at = 0;
    while let Some(&c) = chars.get(at) {
        let column = at + 1;
        let next = chars.get(at + 1).copied();
        let (token, len) = match c {
            c if c.is_whitespace() => {
                at += 1;
                continue;
            }
            '0'..='9' | '.' => number(&chars[at..], column)?,
            '+' => (Token::Op(Op::Add), 1),
            // U+2212 MINUS SIGN: what typeset maths (and models imitating it) write.
            '-' | '\u{2212}' => (Token::Op(Op::Sub), 1),
            '*' if next == Some('*') => (Token::Op(Op::Pow), 2),
            '*' | '×' => (Token::Op(Op::Mul), 1),
            '/' if next == Some('/') => (Token::Op(Op::FloorDiv), 2),
            '/' | '÷' => (Token::Op(Op::Div), 1),
            '%' => (Token::Op(Op::Mod), 1),
            '(' => (Token::Open, 1),
            ')' => (Token::Close, 1),
            '^' => return Err(syntax(column, "'^' is not an operator here; write powers as **")),
            other => {
                return Err(syntax(
                    column,
                    format!(
                        "unexpected {other:?}; only numbers, + - * / // % **, and parentheses are allowed"
                    ),
                ))
            }
        };
        tokens.push((token, column));
        at += len;
    }
    Ok(tokens)
}

/// The number at the start of `chars` (at `column`) and how many characters it takes: digits
/// with optional `_` separators, an optional fraction (`2.5`, `.5`, `5.`), an optional exponent
/// (`1e-3`), all exact.
fn number(chars: &[char], column: usize) -> Result<(Token, usize), EvalError> {
    let mut at = 0;
    let whole = digits(chars, &mut at, column)?;
    let mut fraction = String::new();
    if chars.get(at) == Some(&'.') {
        at += 1;
        fraction = digits(chars, &mut at, column)?;
    }
    if whole.is_empty() && fraction.is_empty() {
        return Err(syntax(column, "a '.' must have digits beside it, as in 0.5"));
    }
    let mut exponent = 0i64;
    if matches!(chars.get(at), Some('e' | 'E')) {
        let mut end = at + 1;
        let negative = chars.get(end) == Some(&'-');
        if matches!(chars.get(end), Some('-' | '+')) {
            end += 1;
        }
        let power = digits(chars, &mut end, column)?;
        if power.is_empty() {
            return Err(syntax(
                column + at,
                "an exponent needs digits, as in 1e5 or 2.5e-3",
            ));
        }
        // An exponent above MAX_DIGITS makes the numerator or denominator too large (for any
        // mantissa but 0, which nobody writes that way).
        let power: i64 = power
            .parse()
            .ok()
            .filter(|&power| power <= i64::from(MAX_DIGITS))
            .ok_or(EvalError::TooLarge(column))?;
        exponent = if negative { -power } else { power };
        at = end;
    }
    let mantissa: BigInt = format!("0{whole}{fraction}").parse().expect("only ASCII digits");
    // `fraction` is at most MAX_CHARS long, so the scale stays small.
    let scale = exponent - fraction.len() as i64;
    let ten = BigInt::from(10).pow(scale.unsigned_abs() as u32);
    let value = if scale >= 0 {
        BigRational::from_integer(mantissa * ten)
    } else {
        BigRational::new(mantissa, ten)
    };
    Ok((Token::Number(bounded(value, column)?), at))
}

/// The digits from `chars[*at]` on, without `_` separators, which may only stand between digits
/// (Python's rule). `column` is that of `chars[0]`.
fn digits(chars: &[char], at: &mut usize, column: usize) -> Result<String, EvalError> {
    let mut digits = String::new();
    while let Some(&c) = chars.get(*at) {
        match c {
            '0'..='9' => digits.push(c),
            '_' if !digits.is_empty() && chars.get(*at + 1).is_some_and(char::is_ascii_digit) => {}
            '_' => {
                return Err(syntax(
                    column + *at,
                    "'_' may only stand between digits, as in 1_000_000",
                ))
            }
            _ => break,
        }
        *at += 1;
    }
    Ok(digits)
}

struct Parser {
    tokens: std::iter::Peekable<std::vec::IntoIter<(Token, usize)>>,
    /// The column just past the text, where "the end" errors point.
    end_column: usize,
    /// How many `factor`s are open: every level of nesting passes through one.
    depth: usize,
}

impl Parser {
    /// The next token if it is one of `ops`, consumed, with its column.
    fn next_op(&mut self, ops: &[Op]) -> Option<(Op, usize)> {
        match self.tokens.peek() {
            Some(&(Token::Op(op), column)) if ops.contains(&op) => {
                self.tokens.next();
                Some((op, column))
            }
            _ => None,
        }
    }

    fn expression(&mut self) -> Result<BigRational, EvalError> {
        let mut value = self.term()?;
        while let Some((op, column)) = self.next_op(&[Op::Add, Op::Sub]) {
            let right = self.term()?;
            value = apply(op, value, right, column)?;
        }
        Ok(value)
    }

    fn term(&mut self) -> Result<BigRational, EvalError> {
        let mut value = self.factor()?;
        while let Some((op, column)) = self.next_op(&[Op::Mul, Op::Div, Op::FloorDiv, Op::Mod]) {
            let right = self.factor()?;
            value = apply(op, value, right, column)?;
        }
        Ok(value)
    }

    fn factor(&mut self) -> Result<BigRational, EvalError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(EvalError::TooDeep);
        }
        let value = match self.next_op(&[Op::Add, Op::Sub]) {
            Some((Op::Sub, _)) => self.factor().map(|value| -value),
            Some(_) => self.factor(),
            None => self.power(),
        };
        self.depth -= 1;
        value
    }

    fn power(&mut self) -> Result<BigRational, EvalError> {
        let base = self.primary()?;
        match self.next_op(&[Op::Pow]) {
            Some((op, column)) => {
                let exponent = self.factor()?;
                apply(op, base, exponent, column)
            }
            None => Ok(base),
        }
    }

    fn primary(&mut self) -> Result<BigRational, EvalError> {
        match self.tokens.next() {
            Some((Token::Number(value), _)) => Ok(value),
            Some((Token::Open, open)) => {
                let value = self.expression()?;
                match self.tokens.next() {
                    Some((Token::Close, _)) => Ok(value),
                    Some((token, column)) => Err(syntax(
                        column,
                        format!(
                            "expected ')' to close the '(' at column {open} but found {}",
                            token.describe()
                        ),
                    )),
                    None => Err(syntax(
                        self.end_column,
                        format!("the '(' at column {open} is never closed"),
                    )),
                }
            }
            Some((token, column)) => Err(syntax(
                column,
                format!("expected a number or '(' but found {}", token.describe()),
            )),
            None => Err(syntax(
                self.end_column,
                "expected a number or '(' but the expression ended",
            )),
        }
    }
}

/// `left op right`, with Python's floor semantics for `//` and `%` (the quotient rounds toward
/// negative infinity; the remainder takes the divisor's sign). `column` is the operator's.
fn apply(op: Op, left: BigRational, right: BigRational, column: usize) -> Result<BigRational, EvalError> {
    if matches!(op, Op::Div | Op::FloorDiv | Op::Mod) && right.is_zero() {
        return Err(EvalError::DivisionByZero(column));
    }
    let value = match op {
        Op::Add => left + right,
        Op::Sub => left - right,
        Op::Mul => left * right,
        Op::Div => left / right,
        Op::FloorDiv => (left / right).floor(),
        Op::Mod => {
            let quotient = (&left / &right).floor();
            left - right * quotient
        }
        Op::Pow => power(left, right, column)?,
    };
    bounded(value, column)
}

fn power(base: BigRational, exponent: BigRational, column: usize) -> Result<BigRational, EvalError> {
    if !exponent.is_integer() {
        return Err(EvalError::FractionalExponent(column));
    }
    let exponent = exponent.to_integer();
    // 0, 1 and -1 stay small under any exponent, however large.
    if base.is_zero() {
        return match exponent.sign() {
            num_bigint::Sign::Minus => Err(EvalError::DivisionByZero(column)),
            num_bigint::Sign::NoSign => Ok(BigRational::one()),
            num_bigint::Sign::Plus => Ok(base),
        };
    }
    if base.abs().is_one() {
        let odd = !(&exponent % 2u32).is_zero();
        return Ok(if base.is_negative() && odd {
            base
        } else {
            BigRational::one()
        });
    }
    // Every other base has a numerator or denominator of at least 2 bits, so a result would
    // have at least (bits - 1) * |exponent| bits: refuse before computing what cannot be kept.
    let bits = base.numer().bits().max(base.denom().bits()) - 1;
    let magnitude = exponent
        .magnitude()
        .to_u32()
        .filter(|&magnitude| bits.saturating_mul(u64::from(magnitude)) <= MAX_BITS)
        .ok_or(EvalError::TooLarge(column))?;
    let numer = base.numer().pow(magnitude);
    let denom = base.denom().pow(magnitude);
    Ok(if exponent.is_negative() {
        BigRational::new(denom, numer)
    } else {
        // Powers of coprime numbers stay coprime, and the denominator stays positive.
        BigRational::new_raw(numer, denom)
    })
}

/// `value` if its numerator and denominator are within the size limit.
fn bounded(value: BigRational, column: usize) -> Result<BigRational, EvalError> {
    if value.numer().bits() > MAX_BITS || value.denom().bits() > MAX_BITS {
        return Err(EvalError::TooLarge(column));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(text: &str) -> String {
        match evaluate(text) {
            Ok(value) => value.to_string(),
            Err(error) => panic!("{text:?} failed: {error}"),
        }
    }

    fn error(text: &str) -> String {
        match evaluate(text) {
            Ok(value) => panic!("{text:?} gave {value}, expected an error"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn big_products_are_exact() {
        assert_eq!(eval("98765432123 * 123456789"), "12193263114103033047");
        assert_eq!(
            eval("123456789012345678901234567890 * 987654321098765432109876543210"),
            "121932631137021795226185032733622923332237463801111263526900"
        );
        assert_eq!(eval("2 ** 100"), "1267650600228229401496703205376");
        assert_eq!(eval("2**64 - 1"), "18446744073709551615");
    }

    #[test]
    fn precedence_and_associativity_follow_python() {
        assert_eq!(eval("2 + 3 * 4"), "14");
        assert_eq!(eval("(2 + 3) * 4"), "20");
        assert_eq!(eval("10 - 4 - 3"), "3");
        assert_eq!(eval("2 * 3 ** 2"), "18");
        assert_eq!(eval("100 / 10 / 5"), "2");
        assert_eq!(eval("2 ** 3 ** 2"), "512");
        assert_eq!(eval("7 + 10 // 3 * 2 % 5"), "8");
    }

    #[test]
    fn unary_signs_bind_looser_than_power_on_their_right() {
        assert_eq!(eval("-2 ** 2"), "-4");
        assert_eq!(eval("(-2) ** 2"), "4");
        assert_eq!(eval("2 ** -1"), "1/2");
        assert_eq!(eval("-(3)"), "-3");
        assert_eq!(eval("--3"), "3");
        assert_eq!(eval("+-+3"), "-3");
        assert_eq!(eval("3 - -3"), "6");
        assert_eq!(eval("(2/3) ** -2"), "9/4");
    }

    #[test]
    fn floor_division_and_modulo_of_negatives_follow_python() {
        assert_eq!(eval("7 // 2"), "3");
        assert_eq!(eval("-7 // 2"), "-4");
        assert_eq!(eval("7 // -2"), "-4");
        assert_eq!(eval("-7 // -2"), "3");
        assert_eq!(eval("7 % 3"), "1");
        assert_eq!(eval("-7 % 3"), "2");
        assert_eq!(eval("7 % -3"), "-2");
        assert_eq!(eval("-7 % -3"), "-1");
        assert_eq!(eval("7.5 // 2"), "3");
        assert_eq!(eval("7.5 % 2"), "3/2");
    }

    #[test]
    fn division_is_exact() {
        assert_eq!(eval("7 / 3"), "7/3");
        assert_eq!(eval("6 / 3"), "2");
        assert_eq!(eval("1/3 + 1/6"), "1/2");
        assert_eq!(eval("-1 / 4"), "-1/4");
    }

    #[test]
    fn decimals_exponents_separators_and_symbols_are_exact() {
        assert_eq!(eval("2.5"), "5/2");
        assert_eq!(eval("0.1 + 0.2"), "3/10");
        assert_eq!(eval(".5 + 5."), "11/2");
        assert_eq!(eval("1e3"), "1000");
        assert_eq!(eval("2.5E-3"), "1/400");
        assert_eq!(eval("1_000_000 * 3"), "3000000");
        assert_eq!(eval("6 × 7 ÷ 2 − 1"), "20");
        assert_eq!(eval(" \t( 1 +\n2 ) "), "3");
    }

    #[test]
    fn powers_of_zero_and_one_with_huge_exponents_are_fine() {
        assert_eq!(eval("0 ** 0"), "1");
        assert_eq!(eval("0 ** 10**100"), "0");
        assert_eq!(eval("1 ** 10**1000"), "1");
        assert_eq!(eval("(-1) ** (10**100 + 1)"), "-1");
        assert_eq!(eval("(-1) ** 10**100"), "1");
    }

    #[test]
    fn syntax_errors_give_the_column() {
        assert_eq!(
            error("2 +"),
            "syntax error at column 4: expected a number or '(' but the expression ended"
        );
        assert_eq!(
            error("2 * * 3"),
            "syntax error at column 5: expected a number or '(' but found '*'"
        );
        assert_eq!(
            error("2 3"),
            "syntax error at column 3: expected an operator but found a number"
        );
        assert_eq!(
            error("(1 + 2"),
            "syntax error at column 7: the '(' at column 1 is never closed"
        );
        assert_eq!(
            error("1 + 2)"),
            "syntax error at column 6: this ')' closes no '('"
        );
        assert_eq!(
            error("2 ^ 3"),
            "syntax error at column 3: '^' is not an operator here; write powers as **"
        );
        assert_eq!(
            error("2 + x"),
            "syntax error at column 5: unexpected 'x'; only numbers, + - * / // % **, and parentheses \
             are allowed"
        );
        assert_eq!(
            error("1__0"),
            "syntax error at column 2: '_' may only stand between digits, as in 1_000_000"
        );
        assert_eq!(
            error("1 + ."),
            "syntax error at column 5: a '.' must have digits beside it, as in 0.5"
        );
        assert_eq!(
            error("1e+"),
            "syntax error at column 2: an exponent needs digits, as in 1e5 or 2.5e-3"
        );
        assert_eq!(error("  "), "the expression is empty");
    }

    #[test]
    fn division_by_zero_is_an_error_at_the_operator() {
        assert_eq!(error("1 / 0"), "division by zero at column 3");
        assert_eq!(error("1 // (2 - 2)"), "division by zero at column 3");
        assert_eq!(error("5 % 0.0"), "division by zero at column 3");
        assert_eq!(error("0 ** -1"), "division by zero at column 3");
    }

    #[test]
    fn fractional_exponents_are_refused() {
        assert_eq!(
            error("2 ** 0.5"),
            "the exponent of the ** at column 3 is not a whole number, so the power is not exact"
        );
    }

    #[test]
    fn sizes_are_bounded() {
        assert_eq!(
            error("2 ** 100000"),
            "the number at column 3 is too large: the limit is 10000 digits"
        );
        assert_eq!(
            error("10 ** 10 ** 10"),
            "the number at column 4 is too large: the limit is 10000 digits"
        );
        assert_eq!(
            error("7 ** (2 ** 64)"),
            "the number at column 3 is too large: the limit is 10000 digits"
        );
        assert_eq!(
            error("2 ** -100000"),
            "the number at column 3 is too large: the limit is 10000 digits"
        );
        assert_eq!(
            error("1e20000"),
            "the number at column 1 is too large: the limit is 10000 digits"
        );
        // Just under the limit is fine; squaring it is not.
        assert_eq!(eval("10 ** 9999").len(), 10_000);
        assert_eq!(
            error("(10 ** 9999) * (10 ** 9999)"),
            "the number at column 14 is too large: the limit is 10000 digits"
        );
    }

    #[test]
    fn input_length_and_nesting_are_bounded() {
        let long = format!("1{}", " + 1".repeat(250));
        assert_eq!(
            error(&long),
            "the expression is 1001 characters long; the limit is 1000"
        );
        let fits = format!("1{}", " + 1".repeat(249));
        assert_eq!(eval(&fits), "250");

        let deep = format!("{}1{}", "(".repeat(150), ")".repeat(150));
        assert_eq!(
            error(&deep),
            "parentheses, signs and powers nest more than 100 deep"
        );
        assert_eq!(
            error(&"-".repeat(200)),
            "parentheses, signs and powers nest more than 100 deep"
        );
        let nested = format!("{}1{}", "(".repeat(90), ")".repeat(90));
        assert_eq!(eval(&nested), "1");
    }
}
