// llama.cpp's chat request preparation (common_chat_templates_apply) and output parsing
// (common_chat_parse) as a test oracle.
//
// Usage: chat-params < requests > answers, one JSON object a line each way.
//   {"template": PATH, "messages": [...], "tools": [...], "tool_choice": "auto|required|none",
//    "parallel_tool_calls": B, "reasoning_format": "none|auto|deepseek", "enable_thinking": B,
//    "add_generation_prompt": B, "json_schema": S or "", "chat_template_kwargs": {K: JSON text},
//    "continue_final_message": "none|auto|content|reasoning_content", "force_pure_content": B,
//    "outputs": ["model output", ...], "partial_outputs": ["output so far", ...]}
//   -> {"prompt", "generation_prompt", "grammar", "grammar_lazy", "grammar_triggers": [[type, value]],
//       "preserved_tokens", "additional_stops", "supports_thinking", "thinking_start_tag",
//       "thinking_end_tags", "parser": arena (common_peg_arena::to_json),
//       "parsed": [message (to_json_oaicompat) or {"error": what()} for each output],
//       "partial": [the same for each partial output, parsed as still streaming]}
// The template is loaded with empty BOS/EOS texts. Any failure: {"error": what()}.
#include "chat.h"
#include "json.h"
#include "peg-parser.h"

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

using json = common_json;

static json answer(const json & req) {
    std::ifstream file(req.at("template").get<std::string>(), std::ios::binary);
    std::ostringstream text;
    text << file.rdbuf();
    auto tmpls = common_chat_templates_init(nullptr, text.str(), "", "");

    common_chat_templates_inputs inputs;
    inputs.messages = common_chat_msgs_parse_oaicompat(req.at("messages"));
    if (req.contains("tools")) {
        inputs.tools = common_chat_tools_parse_oaicompat(req.at("tools"));
    }
    inputs.tool_choice           = common_chat_tool_choice_parse_oaicompat(req.value("tool_choice", std::string("auto")));
    inputs.parallel_tool_calls   = req.value("parallel_tool_calls", false);
    inputs.reasoning_format      = common_reasoning_format_from_name(req.value("reasoning_format", std::string("none")));
    inputs.enable_thinking       = req.value("enable_thinking", true);
    inputs.add_generation_prompt = req.value("add_generation_prompt", true);
    inputs.json_schema           = req.value("json_schema", std::string(""));
    inputs.force_pure_content    = req.value("force_pure_content", false);
    const std::string cont       = req.value("continue_final_message", std::string("none"));
    inputs.continue_final_message = cont == "auto"              ? COMMON_CHAT_CONTINUATION_AUTO :
                                    cont == "content"           ? COMMON_CHAT_CONTINUATION_CONTENT :
                                    cont == "reasoning_content" ? COMMON_CHAT_CONTINUATION_REASONING :
                                                                  COMMON_CHAT_CONTINUATION_NONE;
    if (req.contains("chat_template_kwargs")) {
        for (const auto & [k, v] : req.at("chat_template_kwargs").items()) {
            inputs.chat_template_kwargs[k] = v.get<std::string>();
        }
    }

    auto params = common_chat_templates_apply(tmpls.get(), inputs);
    json out;
    out["prompt"]            = params.prompt;
    out["generation_prompt"] = params.generation_prompt;
    out["grammar"]           = params.grammar;
    out["grammar_lazy"]      = params.grammar_lazy;
    json triggers = json::array();
    for (const auto & t : params.grammar_triggers) {
        json pair = json::array();
        pair.push_back(json((int64_t) t.type));
        pair.push_back(json(t.value));
        triggers.push_back(pair);
    }
    out["grammar_triggers"] = triggers;
    json preserved = json::array();
    for (const auto & t : params.preserved_tokens) {
        preserved.push_back(json(t));
    }
    out["preserved_tokens"] = preserved;
    json stops = json::array();
    for (const auto & t : params.additional_stops) {
        stops.push_back(json(t));
    }
    out["additional_stops"]   = stops;
    out["supports_thinking"]  = params.supports_thinking;
    out["thinking_start_tag"] = params.thinking_start_tag;
    json ends = json::array();
    for (const auto & t : params.thinking_end_tags) {
        ends.push_back(json(t));
    }
    out["thinking_end_tags"] = ends;
    common_peg_arena arena;
    arena.load(params.parser);
    out["parser"] = arena.to_json();

    common_chat_parser_params pp(params);
    pp.reasoning_format = inputs.reasoning_format;
    pp.parser           = arena;
    json parsed = json::array();
    if (req.contains("outputs")) {
        for (const auto & o : req.at("outputs")) {
            try {
                auto msg = common_chat_parse(o.get<std::string>(), false, pp);
                parsed.push_back(msg.to_json_oaicompat());
            } catch (const std::exception & e) {
                json err;
                err["error"] = e.what();
                parsed.push_back(err);
            }
        }
    }
    out["parsed"] = parsed;
    json partial = json::array();
    if (req.contains("partial_outputs")) {
        for (const auto & o : req.at("partial_outputs")) {
            try {
                auto msg = common_chat_parse(o.get<std::string>(), true, pp);
                partial.push_back(msg.to_json_oaicompat());
            } catch (const std::exception & e) {
                json err;
                err["error"] = e.what();
                partial.push_back(err);
            }
        }
    }
    out["partial"] = partial;
    return out;
}

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        json out;
        try {
            out = answer(json::parse(line));
        } catch (const std::exception & e) {
            out["error"] = e.what();
        }
        std::cout << out.dump() << std::endl;
    }
    return 0;
}
