// llama.cpp's differential template analysis (common/chat-diff-analyzer.cpp) as a test oracle.
//
// Usage: chat-analysis TEMPLATE.jinja... > answers, one JSON object a line per template:
//   {"caps": {...}, "user_start": ..., "assistant_start": ..., "reasoning": {...}, "content": {...},
//    "format": {...}, "function": {...}, "arguments": {...}, "call_id": {...},
//    "preserved_tokens": [...], "additional_stops": [...]}   or {"error": what()}
// Enums are written by name (TAG_BASED, JSON_NATIVE, ...). The template is loaded with empty
// BOS/EOS texts, as llama.cpp's own analysis tests load it.
#include "chat-auto-parser.h"
#include "chat.h"

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

using ojson = nlohmann::ordered_json;

template <typename T> static std::string name_of(T value) {
    std::ostringstream out;
    out << value;
    return out.str();
}

static ojson analyse(const std::string & path) {
    std::ifstream file(path, std::ios::binary);
    std::ostringstream text;
    text << file.rdbuf();
    ojson out;
    try {
        common_chat_template tmpl(text.str(), "", "");
        autoparser::autoparser a;
        a.analyze_template(tmpl);
        const auto caps = tmpl.original_caps();
        const auto & t  = a.tools;
        out["caps"] = {
            { "supports_tools", caps.supports_tools },
            { "supports_tool_calls", caps.supports_tool_calls },
            { "supports_system_role", caps.supports_system_role },
            { "supports_parallel_tool_calls", caps.supports_parallel_tool_calls },
            { "supports_string_content", caps.supports_string_content },
            { "supports_typed_content", caps.supports_typed_content },
            { "supports_object_arguments", caps.supports_object_arguments },
        };
        out["user_start"]      = a.user_start;
        out["assistant_start"] = a.assistant_start;
        out["reasoning"] = { { "mode", name_of(a.reasoning.mode) }, { "start", a.reasoning.start },
                             { "end", a.reasoning.end } };
        out["content"] = { { "mode", name_of(a.content.mode) }, { "start", a.content.start },
                           { "end", a.content.end },
                           { "requires_nonnull_content", a.content.requires_nonnull_content } };
        out["format"] = {
            { "mode", name_of(t.format.mode) },
            { "section_start", t.format.section_start },
            { "section_end", t.format.section_end },
            { "per_call_start", t.format.per_call_start },
            { "per_call_end", t.format.per_call_end },
            { "fun_name_is_key", t.format.fun_name_is_key },
            { "tools_array_wrapped", t.format.tools_array_wrapped },
            { "openai_wrapper_trigger", t.format.openai_wrapper_trigger },
            { "function_field", t.format.function_field },
            { "name_field", t.format.name_field },
            { "args_field", t.format.args_field },
            { "id_field", t.format.id_field },
            { "gen_id_field", t.format.gen_id_field },
            { "parameter_order", t.format.parameter_order },
        };
        out["function"] = { { "name_prefix", t.function.name_prefix },
                            { "name_suffix", t.function.name_suffix },
                            { "args_separator", t.function.args_separator },
                            { "close", t.function.close } };
        out["arguments"] = { { "start", t.arguments.start },
                             { "end", t.arguments.end },
                             { "name_prefix", t.arguments.name_prefix },
                             { "name_suffix", t.arguments.name_suffix },
                             { "value_prefix", t.arguments.value_prefix },
                             { "value_suffix", t.arguments.value_suffix },
                             { "separator", t.arguments.separator },
                             { "tolerate_intertag_whitespace", t.arguments.tolerate_intertag_whitespace } };
        out["call_id"] = { { "pos", name_of(t.call_id.pos) }, { "prefix", t.call_id.prefix },
                           { "suffix", t.call_id.suffix } };
        out["preserved_tokens"] = a.preserved_tokens;
        out["additional_stops"] = a.additional_stops;
    } catch (const std::exception & e) {
        out["error"] = e.what();
    }
    return out;
}

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; i++) {
        std::cout << analyse(argv[i]).dump() << "\n";
    }
    return 0;
}
