// llama.cpp's own schema-to-grammar conversion as a test oracle.
//
// Usage: json-schema-grammar MODEL.gguf < requests > answers, one JSON object a line each way.
//   {"mode": "completion", "schema": S}              json_schema_to_grammar(S), as /completion does
//   {"mode": "chat", "schema": S, "messages": [...]}  common_chat_templates_apply with json_schema S
//                                                     and the model's chat template, as chat does
// Answer: {"grammar": ..., "lazy": ..., "generation_prompt": ...} or {"error": what()}.
#include "chat.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "llama.h"

#include <iostream>
#include <string>

using json = common_json;

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::cerr << "usage: json-schema-grammar MODEL.gguf\n";
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    auto mparams       = llama_model_default_params();
    mparams.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        std::cerr << "cannot load " << argv[1] << "\n";
        return 1;
    }
    auto tmpls = common_chat_templates_init(model, "");
    std::string line;
    while (std::getline(std::cin, line)) {
        json req = json::parse(line);
        json out = json::object();
        try {
            if (req.at("mode").get<std::string>() == "completion") {
                out["grammar"] = json_schema_to_grammar(req.at("schema"));
            } else {
                common_chat_templates_inputs inputs;
                inputs.messages    = common_chat_msgs_parse_oaicompat(req.at("messages"));
                inputs.json_schema = req.at("schema").dump();
                auto params              = common_chat_templates_apply(tmpls.get(), inputs);
                out["grammar"]           = params.grammar;
                out["lazy"]              = params.grammar_lazy;
                out["generation_prompt"] = params.generation_prompt;
            }
        } catch (const std::exception & e) {
            out["error"] = std::string(e.what());
        }
        std::cout << out.dump() << std::endl;
    }
    llama_model_free(model);
    return 0;
}
