// llama.cpp's PEG parser and chat layer as a test oracle.
//
// Usage: peg-parser < requests > answers, one JSON object a line each way. An arena is given in
// its serialized form (common_peg_arena::to_json), inputs as hex (they may be bad UTF-8).
//   {"op": "parse", "arena": A, "input": HEX, "flags": F}
//       -> {"type", "start", "end", "nodes", "invalid": [[pos, len]...],
//           "ast": [{"rule", "tag", "start", "end", "partial", "children", "invalid"}...]}
//   {"op": "grammar", "arena": A, "schemas": {"ID": schema...}, "lazy": B}
//       -> {"grammar"}; the schema parsers get their schemas back (the serialized form drops them)
//   {"op": "chat", "arena": A, "input": HEX, "partial": B, "generation_prompt": S, "format": NAME}
//       -> {"role", "content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}
//   {"op": "build", "what": NAME, "args": {...}}
//       -> {"arena": A, "grammar", "lazy_grammar"}: llama.cpp's own builder for one of
//          standard_json_tools, standard_constructed_tools, python_style_tool_calls, permute
// Any failure: {"error": what()}.
#include "chat-peg-parser.h"
#include "chat.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "peg-parser.h"

#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

using json = common_json;

static std::string from_hex(const std::string & hex) {
    std::string out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    return out;
}

static json invalid_list(const std::vector<common_peg_invalid_utf8> & runs) {
    json out = json::array();
    for (const auto & r : runs) {
        json pair = json::array();
        pair.push_back(json((int64_t) r.pos));
        pair.push_back(json((int64_t) r.len));
        out.push_back(pair);
    }
    return out;
}

static json ids_list(const std::vector<size_t> & ids) {
    json out = json::array();
    for (auto id : ids) {
        out.push_back(json((int64_t) id));
    }
    return out;
}

static common_chat_format format_of(const std::string & name) {
    for (int f = 0; f < COMMON_CHAT_FORMAT_COUNT; f++) {
        if (name == common_chat_format_name((common_chat_format) f)) {
            return (common_chat_format) f;
        }
    }
    throw std::runtime_error("unknown format " + name);
}

static std::vector<std::string> strings_of(const json & j) {
    std::vector<std::string> out;
    for (size_t i = 0; i < j.size(); i++) {
        out.push_back(j.at(i).get<std::string>());
    }
    return out;
}

static json grammar_of(const common_peg_arena & arena, bool lazy) {
    return json(build_grammar([&](const common_grammar_builder & b) { arena.build_grammar(b, lazy); }));
}

static common_peg_arena build_one(const std::string & what, const json & a) {
    return build_chat_peg_parser([&](common_chat_peg_builder & p) -> common_peg_parser {
        if (what == "standard_json_tools") {
            return p.standard_json_tools(a.at("section_start").get<std::string>(), a.at("section_end").get<std::string>(),
                                         a.at("tools"), a.at("parallel").get<bool>(), a.at("force").get<bool>(),
                                         a.value("name_key", std::string()), a.value("args_key", std::string()),
                                         a.value("array_wrapped", false), a.value("function_is_key", false),
                                         a.value("call_id_key", std::string()), a.value("gen_call_id_key", std::string()),
                                         a.contains("parameters_order") ? strings_of(a.at("parameters_order")) : std::vector<std::string>{},
                                         a.value("accept_openai_wrapper", false));
        }
        if (what == "standard_constructed_tools") {
            std::map<std::string, std::string> markers;
            const json & m = a.at("markers");
            for (const auto & entry : m.items()) {
                markers[entry.key()] = entry.value().get<std::string>();
            }
            return p.standard_constructed_tools(markers, a.at("tools"), a.at("parallel").get<bool>(), a.at("force").get<bool>());
        }
        if (what == "python_style_tool_calls") {
            return p.python_style_tool_calls(a.at("tools"), a.at("parallel").get<bool>(), a.at("json_literals").get<bool>());
        }
        if (what == "permute") {
            std::vector<common_peg_parser> parts;
            for (const auto & s : strings_of(a.at("literals"))) {
                parts.push_back(p.until(s) + p.literal(s));
            }
            return p.permute(a.at("prefix").get<std::string>(), parts);
        }
        if (what == "optspace") {
            return p.optspace(a.at("tag").get<std::string>()) + p.tag_with_safe_content("safe", a.at("marker").get<std::string>(), p.literal("x"));
        }
        throw std::runtime_error("unknown builder " + what);
    });
}

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        json req = json::parse(line);
        json out = json::object();
        try {
            const std::string op = req.at("op").get<std::string>();
            if (op == "build") {
                auto arena = build_one(req.at("what").get<std::string>(), req.at("args"));
                out["arena"] = arena.to_json();
                out["grammar"] = grammar_of(arena, false);
                out["lazy_grammar"] = grammar_of(arena, true);
            } else {
                auto arena = common_peg_arena::from_json(req.at("arena"));
                if (op == "parse") {
                    common_peg_parse_context ctx(from_hex(req.at("input").get<std::string>()),
                                                 (common_peg_parse_flags) req.at("flags").get<int>());
                    auto r = arena.parse(ctx);
                    out["type"] = json(common_peg_parse_result_type_name(r.type));
                    out["start"] = json((int64_t) r.start);
                    out["end"] = json((int64_t) r.end);
                    out["nodes"] = ids_list(r.nodes);
                    out["invalid"] = invalid_list(r.invalid_utf8);
                    json ast = json::array();
                    for (size_t i = 0; i < ctx.ast.size(); i++) {
                        const auto & n = ctx.ast.get(i);
                        json node = json::object();
                        node["rule"] = json(n.rule);
                        node["tag"] = json(n.tag);
                        node["start"] = json((int64_t) n.start);
                        node["end"] = json((int64_t) n.end);
                        node["partial"] = json(n.is_partial);
                        node["children"] = ids_list(n.children);
                        node["invalid"] = invalid_list(n.invalid_utf8);
                        ast.push_back(node);
                    }
                    out["ast"] = ast;
                } else if (op == "grammar") {
                    if (req.contains("schemas")) {
                        for (const auto & entry : req.at("schemas").items()) {
                            auto & sp = std::get<common_peg_schema_parser>(arena.get(std::stoul(entry.key())));
                            auto doc = std::make_shared<const common_chat_schema_document>(common_chat_schema_from_json(entry.value()));
                            sp.node = doc->root.get();
                            sp.doc = doc;
                        }
                    }
                    out["grammar"] = grammar_of(arena, req.at("lazy").get<bool>());
                } else if (op == "chat") {
                    common_chat_parser_params params;
                    params.format = format_of(req.at("format").get<std::string>());
                    params.generation_prompt = req.at("generation_prompt").get<std::string>();
                    auto msg = common_chat_peg_parse(arena, from_hex(req.at("input").get<std::string>()),
                                                     req.at("partial").get<bool>(), params);
                    out["role"] = json(msg.role);
                    out["content"] = json(msg.content);
                    out["reasoning_content"] = json(msg.reasoning_content);
                    json calls = json::array();
                    for (const auto & tc : msg.tool_calls) {
                        json call = json::object();
                        call["name"] = json(tc.name);
                        call["arguments"] = json(tc.arguments);
                        call["id"] = json(tc.id);
                        calls.push_back(call);
                    }
                    out["tool_calls"] = calls;
                } else {
                    throw std::runtime_error("unknown op " + op);
                }
            }
        } catch (const std::exception & e) {
            out = json::object();
            out["error"] = json(std::string(e.what()));
        }
        std::cout << out.dump_safe() << "\n" << std::flush;
    }
    return 0;
}
