//! Stop strings: text that could still become a stop string is held back, and a matched
//! stop string is never emitted (unless `include_stop_str_in_output`).

#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    include_in_output: bool,
    text: String,
    emitted: usize,
}

/// What became final after some new text arrived.
#[derive(Debug, PartialEq, Eq)]
pub struct StopCheck {
    pub text: String,
    /// The stop string that ended the text, if one did.
    pub matched: Option<String>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>, include_in_output: bool) -> Self {
        Self {
            stops,
            include_in_output,
            text: String::new(),
            emitted: 0,
        }
    }

    pub fn push(&mut self, delta: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck {
                text: delta.to_string(),
                matched: None,
            };
        }
        // A match can only start in text not yet emitted (everything emitted was checked).
        let search_from = self.emitted;
        self.text.push_str(delta);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|p| (search_from + p, s.len(), s))
            })
            .min();
        if let Some((pos, len, s)) = hit {
            let end = if self.include_in_output {
                pos + len
            } else {
                pos
            };
            let out = self.text[self.emitted..end.max(self.emitted)].to_string();
            self.emitted = self.text.len();
            return StopCheck {
                text: out,
                matched: Some(s.clone()),
            };
        }
        let safe_end = self.text.len() - self.held_back_len();
        let out = self.text[self.emitted..safe_end].to_string();
        self.emitted = safe_end;
        StopCheck {
            text: out,
            matched: None,
        }
    }

    /// Longest suffix of the text that is a proper prefix of some stop string.
    fn held_back_len(&self) -> usize {
        let pending = &self.text[self.emitted..];
        self.stops
            .iter()
            .map(|s| {
                (1..s.len().min(pending.len() + 1))
                    .rev()
                    .find(|&k| {
                        s.is_char_boundary(k)
                            && pending.len() >= k
                            && pending.is_char_boundary(pending.len() - k)
                            && pending.ends_with(&s[..k])
                    })
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }

    /// Releases held-back text when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], include: bool, pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect(), include);
        let mut out = String::new();
        for p in pieces {
            let c = s.push(p);
            out += &c.text;
            if c.matched.is_some() {
                return (out, true);
            }
        }
        out += &s.flush();
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        assert_eq!(
            run(&["END"], false, &["hello E", "N", "D tail"]),
            ("hello ".into(), true)
        );
        assert_eq!(
            run(&["END"], true, &["hello E", "N", "D tail"]),
            ("hello END".into(), true)
        );
    }

    #[test]
    fn held_back_prefix_released_when_it_does_not_match() {
        let mut s = StopStrings::new(vec!["END".into()], false);
        assert_eq!(s.push("ab E").text, "ab ");
        assert_eq!(s.push("X").text, "EX");
        assert_eq!(run(&["END"], false, &["a", "EN"]), ("aEN".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["ü!", "b"], false, &["aü", "!b"]), ("a".into(), true));
        assert_eq!(run(&["éé"], false, &["xé", "y"]), ("xéy".into(), false));
    }
}
