// llama.cpp's built-in chat templates (src/llama-chat.cpp) as a test oracle: what llama-server
// started with --no-jinja writes for a chat.
//
// Usage: builtin-templates < requests > answers, one JSON object a line each way.
//   {"op": "names"}
//     -> {"names": [...]}                        llama_chat_builtin_templates, in its order
//   {"op": "apply", "template": TEXT, "chat": [[role, content], ...], "add_ass": B}
//     -> {"res": N, "prompt": TEXT}              llama_chat_apply_template (res -1: not supported)
//   {"op": "legacy", "template": TEXT, "messages": [...], "add_generation_prompt": B}
//     -> {"prompt": TEXT} or {"error": what()}   common_chat_templates_apply with use_jinja false
#include "chat.h"
#include "json.h"
#include "llama.h"

#include <iostream>
#include <string>
#include <vector>

using json = common_json;

static json answer(const json & req) {
    const std::string op = req.at("op").get<std::string>();
    json out;
    if (op == "names") {
        std::vector<const char *> names(256);
        const int32_t n = llama_chat_builtin_templates(names.data(), names.size());
        out["names"] = json::array();
        for (int32_t i = 0; i < n; i++) {
            out["names"].push_back(std::string(names[i]));
        }
    } else if (op == "apply") {
        const std::string tmpl = req.at("template").get<std::string>();
        std::vector<std::string> roles, contents;
        for (const auto & m : req.at("chat")) {
            roles.push_back(m.at(0).get<std::string>());
            contents.push_back(m.at(1).get<std::string>());
        }
        std::vector<llama_chat_message> chat;
        for (size_t i = 0; i < roles.size(); i++) {
            chat.push_back({ roles[i].c_str(), contents[i].c_str() });
        }
        const bool add_ass = req.at("add_ass").get<bool>();
        const int32_t res = llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), add_ass, nullptr, 0);
        out["res"] = res;
        if (res >= 0) {
            std::vector<char> buf(res + 1);
            llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), add_ass, buf.data(), buf.size());
            out["prompt"] = std::string(buf.data(), res);
        }
    } else if (op == "legacy") {
        try {
            auto tmpls = common_chat_templates_init(nullptr, req.at("template").get<std::string>(), "", "");
            common_chat_templates_inputs inputs;
            inputs.use_jinja             = false;
            inputs.messages              = common_chat_msgs_parse_oaicompat(req.at("messages"));
            inputs.add_generation_prompt = req.value("add_generation_prompt", true);
            out["prompt"] = common_chat_templates_apply(tmpls.get(), inputs).prompt;
        } catch (const std::exception & e) {
            out["error"] = e.what();
        }
    }
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
