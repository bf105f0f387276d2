//! Which rule, if any, protects a request.
//!
//! Precedence: a rule named by the route's metadata wins; otherwise the first rule, in
//! configuration order, whose `match` accepts the request. The method list applies to both.

use crate::config::{Config, Rule, RuleMatch};

/// What the filter knows of a request when it picks a rule.
#[derive(Debug, Default, Clone, Copy)]
pub struct RequestFacts<'a> {
    pub method: &'a str,
    /// Path without the query.
    pub path: &'a str,
    /// `:authority`, possibly with a port.
    pub authority: &'a str,
    pub route_name: Option<&'a str>,
    pub virtual_host: Option<&'a str>,
    /// Envoy matched a route but names no virtual host (Envoy 1.39's dynamic modules): the
    /// virtual host is unknown, not absent. (With no route matched there is none, and the
    /// router answers the request itself.)
    pub virtual_host_unknown: bool,
    /// The rule name found in the route's metadata.
    pub metadata_rule: Option<&'a str>,
}

/// The outcome of rule selection over rules of type `R` (a `Rule`, or the flow's resolved
/// handle of one).
#[derive(Debug, PartialEq, Eq)]
pub enum Selection<'a, R = Rule> {
    Rule(&'a R),
    /// The rule applies but not to this method: the request passes untouched.
    MethodNotCovered,
    /// Route metadata names a rule that does not exist (a configuration mistake).
    UnknownMetadataRule,
    /// This rule (or a later one) would apply if the request's virtual host were one it
    /// names, and Envoy gives no virtual host name (Envoy 1.39's dynamic modules do not):
    /// the request cannot be let through unprotected, nor told apart.
    VirtualHostUnknown(&'a R),
    NoRule,
}

impl Config {
    /// True when selection needs the route name (a host call the filter can skip otherwise).
    pub fn needs_route_name(&self) -> bool {
        self.needs_route_name
    }

    /// True when selection needs the virtual host name.
    pub fn needs_virtual_host(&self) -> bool {
        self.needs_virtual_host
    }

    pub fn select<'a>(&'a self, facts: &RequestFacts<'_>) -> Selection<'a> {
        select(&self.rules, facts)
    }
}

/// Picks the rule for a request among `rules`, in configuration order.
pub fn select<'a, R: AsRef<Rule>>(rules: &'a [R], facts: &RequestFacts<'_>) -> Selection<'a, R> {
    if let Some(name) = facts.metadata_rule {
        return match rules.iter().find(|r| r.as_ref().name == name) {
            Some(rule) if method_covered(&rule.as_ref().matcher, facts.method) => {
                Selection::Rule(rule)
            }
            Some(_) => Selection::MethodNotCovered,
            None => Selection::UnknownMetadataRule,
        };
    }
    let mut method_miss = false;
    for rule in rules {
        let matcher = &rule.as_ref().matcher;
        if request_matches(matcher, facts) {
            if method_covered(matcher, facts.method) {
                return Selection::Rule(rule);
            }
            method_miss = true;
        } else if facts.virtual_host_unknown
            && !matcher.virtual_hosts.is_empty()
            && method_covered(matcher, facts.method)
            && request_matches(
                matcher,
                &RequestFacts {
                    virtual_host: matcher.virtual_hosts.first().map(String::as_str),
                    ..*facts
                },
            )
        {
            return Selection::VirtualHostUnknown(rule);
        }
    }
    if method_miss {
        Selection::MethodNotCovered
    } else {
        Selection::NoRule
    }
}

fn method_covered(m: &RuleMatch, method: &str) -> bool {
    m.methods.iter().any(|x| x.eq_ignore_ascii_case(method))
}

fn request_matches(m: &RuleMatch, facts: &RequestFacts<'_>) -> bool {
    let route_ok = m.route_names.is_empty()
        || facts
            .route_name
            .is_some_and(|r| m.route_names.iter().any(|n| n == r));
    let vhost_ok = m.virtual_hosts.is_empty()
        || facts
            .virtual_host
            .is_some_and(|v| m.virtual_hosts.iter().any(|n| n == v));
    let path_ok = (m.path_prefixes.is_empty() && m.paths.is_empty())
        || m.path_prefixes
            .iter()
            .any(|p| facts.path.starts_with(p.as_str()))
        || m.paths.iter().any(|p| facts.path == p.as_str());
    let host = host_without_port(facts.authority);
    let host_ok = m.hosts.is_empty() || m.hosts.iter().any(|h| h.eq_ignore_ascii_case(host));
    route_ok && vhost_ok && path_ok && host_ok
}

fn host_without_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        // IPv6 literal: keep up to the closing bracket.
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// What a request must look like for any rule to have something to do with it, decided
/// from the method and the path alone, so that most requests a rule never names (a mesh's
/// reads, other routes) pass without the property reads selection makes (route metadata,
/// route and virtual host names). Never rules out a request `select` (or a lookup route)
/// would take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefilter {
    /// Upper-cased: every rule's methods, and GET and HEAD with a lookup route.
    methods: Vec<String>,
    /// None when the path cannot rule a request out: some rule matches any path. (A rule
    /// named by route metadata applies whatever the path: the caller asks the metadata of
    /// a request this rules out.)
    paths: Option<Paths>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Paths {
    prefixes: Vec<String>,
    exact: Vec<String>,
}

impl Prefilter {
    /// `lookup_paths`: the rules' lookup routes (matched exactly, GET and HEAD).
    pub fn new<'a, R: AsRef<Rule>>(
        rules: &[R],
        lookup_paths: impl IntoIterator<Item = &'a str>,
    ) -> Prefilter {
        let mut methods: Vec<String> = Vec::new();
        let mut paths = Some(Paths::default());
        for rule in rules {
            let matcher = &rule.as_ref().matcher;
            for method in &matcher.methods {
                if !methods.contains(method) {
                    methods.push(method.clone());
                }
            }
            if matcher.path_prefixes.is_empty() && matcher.paths.is_empty() {
                paths = None;
            }
            if let Some(p) = paths.as_mut() {
                p.prefixes.extend(matcher.path_prefixes.iter().cloned());
                p.exact.extend(matcher.paths.iter().cloned());
            }
        }
        let mut has_lookup = false;
        for path in lookup_paths {
            has_lookup = true;
            if let Some(p) = paths.as_mut() {
                p.exact.push(path.to_string());
            }
        }
        if has_lookup {
            for method in ["GET", "HEAD"] {
                if !methods.iter().any(|m| m == method) {
                    methods.push(method.to_string());
                }
            }
        }
        Prefilter { methods, paths }
    }

    /// False when no rule covers `method`: the request is none of the filter's business.
    pub fn method_may_match(&self, method: &[u8]) -> bool {
        self.methods
            .iter()
            .any(|m| m.as_bytes().eq_ignore_ascii_case(method))
    }

    /// False when no rule's paths (nor a lookup route) can match `path` (without query);
    /// a rule named by route metadata may still apply.
    pub fn path_may_match(&self, path: &[u8]) -> bool {
        let Some(p) = &self.paths else {
            return true;
        };
        p.prefixes.iter().any(|x| path.starts_with(x.as_bytes()))
            || p.exact.iter().any(|x| path == x.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn config() -> Config {
        Config::parse(
            br#"{"rules":[
                {"name":"by-route","match":{"route_names":["payments"]}},
                {"name":"orders","match":{"path_prefixes":["/orders"],"hosts":["api.local"]}},
                {"name":"puts","match":{"path_prefixes":["/things"],"methods":["PUT"]}},
                {"name":"meta-only","match":{"path_prefixes":["/never"]}},
                {"name":"by-vhost","match":{"virtual_hosts":["partners"]}}
            ]}"#,
        )
        .unwrap()
    }

    fn prefilter(rules: &str, lookups: &[&str]) -> Prefilter {
        let config = Config::parse(format!(r#"{{"rules":[{rules}]}}"#).as_bytes()).unwrap();
        Prefilter::new(&config.rules, lookups.iter().copied())
    }

    #[test]
    fn the_prefilter_rules_out_only_what_no_rule_can_take() {
        let p = prefilter(
            r#"{"name":"a","match":{"path_prefixes":["/orders"],"methods":["put"]}},
               {"name":"b","match":{"grpc_methods":["shop.v1.Pay/Charge"]}}"#,
            &[],
        );
        assert!(p.method_may_match(b"PUT") && p.method_may_match(b"post"));
        assert!(!p.method_may_match(b"GET") && !p.method_may_match(b"DELETE"));
        assert!(p.path_may_match(b"/orders/7") && p.path_may_match(b"/shop.v1.Pay/Charge"));
        assert!(!p.path_may_match(b"/shop.v1.Pay/Charge2") && !p.path_may_match(b"/search"));

        // A lookup route lets GET and HEAD in, on its path only.
        let p = prefilter(
            r#"{"name":"a","match":{"path_prefixes":["/orders"]}}"#,
            &["/k"],
        );
        assert!(p.method_may_match(b"GET") && p.method_may_match(b"HEAD"));
        assert!(p.path_may_match(b"/k") && !p.path_may_match(b"/k/1"));

        // A rule without paths matches any path (a route name, a host): the path decides
        // nothing then.
        let p = prefilter(
            r#"{"name":"a","match":{"path_prefixes":["/orders"]}},
               {"name":"b","match":{"route_names":["pay"]}}"#,
            &[],
        );
        assert!(p.path_may_match(b"/anything"));
    }

    /// A routed request: Envoy 1.40 names its virtual host.
    fn facts<'a>(method: &'a str, path: &'a str, authority: &'a str) -> RequestFacts<'a> {
        RequestFacts {
            method,
            path,
            authority,
            virtual_host: Some("default"),
            ..Default::default()
        }
    }

    fn name<'a>(s: Selection<'a>) -> Option<&'a str> {
        match s {
            Selection::Rule(r) => Some(r.name.as_str()),
            _ => None,
        }
    }

    #[test]
    fn first_matching_rule_wins() {
        let c = config();
        assert_eq!(
            name(c.select(&facts("POST", "/orders/1", "api.local:8080"))),
            Some("orders")
        );
        assert_eq!(name(c.select(&facts("POST", "/orders/1", "other"))), None);
        let mut f = facts("POST", "/orders/1", "api.local");
        f.route_name = Some("payments");
        assert_eq!(name(c.select(&f)), Some("by-route"));
        assert_eq!(
            name(c.select(&facts("PUT", "/things/1", "x"))),
            Some("puts")
        );
    }

    #[test]
    fn other_methods_pass_untouched() {
        let c = config();
        assert_eq!(
            c.select(&facts("GET", "/orders/1", "api.local")),
            Selection::MethodNotCovered
        );
        assert_eq!(
            c.select(&facts("POST", "/things/1", "x")),
            Selection::MethodNotCovered
        );
        assert_eq!(
            c.select(&facts("POST", "/elsewhere", "x")),
            Selection::NoRule
        );
    }

    #[test]
    fn route_metadata_names_the_rule() {
        let c = config();
        let mut f = facts("POST", "/anything", "x");
        f.metadata_rule = Some("meta-only");
        assert_eq!(name(c.select(&f)), Some("meta-only"));
        f.metadata_rule = Some("missing");
        assert_eq!(c.select(&f), Selection::UnknownMetadataRule);
        f.metadata_rule = Some("meta-only");
        f.method = "GET";
        assert_eq!(c.select(&f), Selection::MethodNotCovered);
    }

    /// Envoy 1.39's dynamic modules give no virtual host name: a request a rule would take
    /// if its virtual host were one the rule names is answered 503, never let through
    /// unprotected; one no rule could take, or one an earlier rule takes, is not.
    #[test]
    fn a_request_whose_virtual_host_is_unknown_never_passes_a_rule_that_may_take_it() {
        let c = config();
        let mut f = facts("POST", "/elsewhere", "x");
        f.virtual_host = None;
        assert_eq!(
            c.select(&f),
            Selection::NoRule,
            "no virtual host, no route: the router answers it"
        );
        f.virtual_host_unknown = true;
        assert!(matches!(c.select(&f), Selection::VirtualHostUnknown(r) if r.name == "by-vhost"));
        f.method = "GET";
        assert_eq!(c.select(&f), Selection::NoRule, "no rule takes a GET");
        let mut f = facts("POST", "/orders/1", "api.local");
        f.virtual_host = None;
        f.virtual_host_unknown = true;
        assert_eq!(
            name(c.select(&f)),
            Some("orders"),
            "an earlier rule takes it"
        );
    }

    #[test]
    fn hosts_compare_without_port_and_case() {
        assert_eq!(host_without_port("API.local:443"), "API.local");
        assert_eq!(host_without_port("[::1]:10000"), "[::1]");
        assert!(config().needs_route_name() && config().needs_virtual_host());
    }
}
